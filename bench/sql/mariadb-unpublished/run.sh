#!/usr/bin/env bash
# run.sh claim-indexes|unpublished|unpublished-null [ROUNDS]: what a kept completion and a bulk
# insert cost MariaDB in each table layout.
#
# In database `exp` (made and dropped here), a table of the outbox's relay columns is made in one
# layout:
#   claim-indexes     the outbox table's own `ix_claim`, `ix_key` and `ix_published`, each holding
#                     `state` (the layout without `unpublished_table`);
#   unpublished       no index holding `state` or `published_at`, a `_unpublished` table of
#                     `(state, seq)` with `(partition_key, state, seq)` filled by an insert
#                     trigger, and `published_at` defaulting to the epoch (`unpublished_table`);
#   unpublished-null  the same with `published_at` NULL until published.
# Then 100,000 rows over 1,000 keys are inserted (two `INSERT ... SELECT`), leased in batches of
# 500, and completed in batches of 500 as the relay does (a transaction: the locking read of the
# held rows, the unpublished entries' delete where there is a table of them, the update of
# `state`, `published_at` and the lease, commit). Prints the server's CPU per row of the insert
# and of the completions (every `mariadbd` process's user + system time, InnoDB's purge waited
# for), ROUNDS times (default 1). Client: `mariadb $MARIADB_ARGS` (default `-uroot`).
set -euo pipefail
v=$1; rounds=${2:-1}
case $v in claim-indexes|unpublished|unpublished-null) ;; *) echo "unknown layout $v" >&2; exit 2;; esac
m() { mariadb ${MARIADB_ARGS:--uroot} exp "$@"; }
cpu() { local t=0; for p in $(pgrep -x mariadbd); do t=$((t + $(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }
hist() { m -N -e "SELECT COUNT FROM information_schema.INNODB_METRICS WHERE NAME = 'trx_rseg_history_len'"; }
settle() { for _ in $(seq 300); do [ "$(hist)" -lt 50 ] && break; sleep 0.1; done; }
hz=$(getconf CLK_TCK)
mariadb ${MARIADB_ARGS:--uroot} -e "DROP DATABASE IF EXISTS exp; CREATE DATABASE exp"
for round in $(seq "$rounds"); do
  m -e "DROP TABLE IF EXISTS t, t_unpublished"
  published="published_at DATETIME(6) DEFAULT '1970-01-01 00:00:00'"
  [ "$v" = unpublished ] || published="published_at DATETIME(6)"
  cols="id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, aggregatetype VARCHAR(255) NOT NULL,
    payload LONGTEXT NOT NULL, seq BIGINT NOT NULL AUTO_INCREMENT, headers LONGTEXT NOT NULL DEFAULT ('{}'),
    partition_key VARCHAR(255), key_hash INT UNSIGNED, dedup_key VARCHAR(255),
    state ENUM('pending', 'published', 'dead') NOT NULL DEFAULT 'pending', attempts INT NOT NULL DEFAULT 0,
    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    lease_token CHAR(36) CHARACTER SET ascii COLLATE ascii_bin DEFAULT '',
    lease_until DATETIME(6) DEFAULT '1970-01-01 00:00:00', last_error TEXT,
    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)), $published,
    PRIMARY KEY (seq), UNIQUE KEY uq_id (id), UNIQUE KEY uq_dedup_key (dedup_key)"
  if [ "$v" = claim-indexes ]; then
    m -e "CREATE TABLE t ($cols, KEY ix_claim (state, seq, key_hash), KEY ix_key (partition_key, state, seq),
          KEY ix_published (state, published_at)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin"
  else
    m -e "CREATE TABLE t ($cols) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
          CREATE TABLE t_unpublished (state ENUM('pending', 'dead') NOT NULL DEFAULT 'pending', seq BIGINT NOT NULL,
            partition_key VARCHAR(255), key_hash INT UNSIGNED, PRIMARY KEY (state, seq),
            KEY ix_key (partition_key, state, seq)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
          CREATE TRIGGER t_unpublished_insert AFTER INSERT ON t FOR EACH ROW
            INSERT INTO t_unpublished (state, seq, partition_key, key_hash)
            SELECT CAST(NEW.state AS CHAR), NEW.seq, NEW.partition_key, NEW.key_hash FROM DUAL
            WHERE NEW.state <> 'published'"
  fi
  settle; c0=$(cpu)
  for _ in 1 2; do
    m -e "INSERT INTO t (id, aggregatetype, payload, partition_key, key_hash)
          SELECT UUID(), 'order', JSON_OBJECT('n', seq, 'pad', REPEAT('x', 100)), CONCAT('k', seq % 1000),
                 CRC32(CONCAT('k', seq % 1000)) FROM seq_1_to_50000"
  done
  settle; c1=$(cpu)
  rows=$(m -N -e "SELECT COUNT(*) FROM t")
  work=$(mktemp -d)
  m -N -e "SELECT seq FROM t ORDER BY seq" | awk -v W="$work" '
    { s[NR] = $1 }
    END { for (i = 1; i <= NR; i += 500) { j = i + 499; if (j > NR) j = NR
      printf "UPDATE t SET lease_token = \"00000000-0000-0000-0000-000000000001\", lease_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND WHERE seq BETWEEN %d AND %d;\n", s[i], s[j] > W "/lease.sql"
      printf "BEGIN; SELECT COUNT(*) FROM (SELECT seq FROM t WHERE seq BETWEEN %d AND %d AND lease_token = \"00000000-0000-0000-0000-000000000001\" FOR UPDATE) x;\n", s[i], s[j] > W "/complete.sql"
      if (LAYOUT != "claim-indexes") printf "DELETE FROM t_unpublished WHERE state = \"pending\" AND seq BETWEEN %d AND %d;\n", s[i], s[j] > W "/complete.sql"
      printf "UPDATE t SET state = \"published\", published_at = UTC_TIMESTAMP(6), lease_token = \"\", lease_until = \"1970-01-01 00:00:00\" WHERE seq BETWEEN %d AND %d; COMMIT;\n", s[i], s[j] > W "/complete.sql" } }' LAYOUT="$v"
  m < "$work/lease.sql"
  settle; c2=$(cpu)
  m < "$work/complete.sql" > /dev/null
  settle; c3=$(cpu)
  rm -r "$work"
  us() { echo "scale=1; ($1) * 1000000 / $hz / $rows" | bc; }
  echo "$v, round $round: insert $(us "$c1 - $c0") µs/row, kept completion $(us "$c3 - $c2") µs/row" \
       "(published $(m -N -e "SELECT COUNT(*) FROM t WHERE state = 'published'") of $rows)"
done
mariadb ${MARIADB_ARGS:--uroot} -e "DROP DATABASE exp"

#!/usr/bin/env bash
# run.sh on|off [PAD]: what MariaDB's CHECK constraints cost the relay's row updates.
#
# Makes a database `exp` (dropped at the end), migrates an outbox table into it with this
# project's CLI, writes 100,000 rows over 1,000 keys whose payload carries PAD bytes of padding
# (default 100), then times 200 lease updates and 200 completions of 500 rows each, by primary
# key, as the relay's statements do, with the table's checks evaluated (`on`, MariaDB's default
# for every UPDATE) or skipped (`off`, `SET STATEMENT check_constraint_checks = 0 FOR`, what the
# relay does since 2026-11-28). Prints µs per message of each. Client: `mariadb $MARIADB_ARGS`
# (default `-uroot`); the store URL for the migration: $EXP_STORE_URL (default
# mysql://root@127.0.0.1:3306/exp).
set -euo pipefail
cd "$(dirname "$0")/../../.."
v=$1; pad=${2:-100}
m() { mariadb ${MARIADB_ARGS:--uroot} exp "$@"; }
mariadb ${MARIADB_ARGS:--uroot} -e "DROP DATABASE IF EXISTS exp; CREATE DATABASE exp"
cargo run -q --release -p outbox-cli -- migrate --store "${EXP_STORE_URL:-mysql://root@127.0.0.1:3306/exp}" >/dev/null
m -e "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, partition_key)
      SELECT UUID(), 'order', CONCAT('k', seq % 1000), 'created',
             JSON_OBJECT('n', seq, 'pad', REPEAT('x', $pad)), CONCAT('k', seq % 1000)
      FROM seq_1_to_100000"
lo=$(m -N -e "SELECT MIN(seq) FROM outbox")
pre=""
[ "$v" = off ] && pre="SET STATEMENT check_constraint_checks = 0 FOR "
work=$(mktemp -d)
for b in $(seq 0 199); do
    a=$((lo + b * 500)); z=$((a + 499))
    echo "${pre}UPDATE outbox SET lease_token = '00000000-0000-0000-0000-000000000001',
          lease_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND WHERE seq BETWEEN $a AND $z;" >> "$work/lease.sql"
    echo "${pre}UPDATE outbox SET state = 'published', published_at = UTC_TIMESTAMP(6),
          lease_token = '', lease_until = '1970-01-01 00:00:00' WHERE seq BETWEEN $a AND $z;" >> "$work/complete.sql"
done
s=$(date +%s.%N); m < "$work/lease.sql"; e=$(date +%s.%N)
s2=$(date +%s.%N); m < "$work/complete.sql"; e2=$(date +%s.%N)
echo "checks $v, padding $pad: lease $(echo "($e - $s) * 10" | bc -l | cut -c1-5) µs/msg," \
     "completion $(echo "($e2 - $s2) * 10" | bc -l | cut -c1-5) µs/msg," \
     "published $(m -N -e "SELECT COUNT(*) FROM outbox WHERE state = 'published'")"
rm -r "$work"
mariadb ${MARIADB_ARGS:--uroot} -e "DROP DATABASE exp"

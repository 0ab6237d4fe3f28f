#!/usr/bin/env bash
# loop.sh today|cursor|nostate [stalled]: µs per message of a 100,000-row drain loop (see
# README.md). With `stalled`, another session keeps a transaction open for the whole drain, so a
# cursor cannot settle past the rows it drains.
source "$(dirname "$0")/common.sh"
v=$1
case $v in today|cursor|nostate) ;; *) echo "usage: $0 today|cursor|nostate [stalled]" >&2; exit 2 ;; esac
fresh
case $v in
    today) q -c "CREATE INDEX ON exp.t (published_at) WHERE state = 'published'" ;;
    nostate) q -c "DROP INDEX exp.t_claim; DROP INDEX exp.t_partition_key_seq_idx; DROP INDEX exp.t_seq_idx;
        CREATE INDEX ON exp.t (seq); CREATE INDEX ON exp.t (partition_key, seq);
        CREATE INDEX ON exp.t (seq) WHERE last_error IS NOT NULL OR available_at > created_at;
        CREATE INDEX ON exp.t (partition_key, seq) WHERE last_error IS NOT NULL OR available_at > created_at;" ;;
esac
q -c "INSERT INTO exp.t (aggregatetype, aggregateid, type, payload, partition_key)
      SELECT 'order', 'k' || (g % 1000), 'created', jsonb_build_object('n', g, 'pad', repeat('x', 100)),
             'k' || (g % 1000)
      FROM generate_series(1, 100000) g"
q -c "VACUUM ANALYZE exp.t"
if [ "${2:-}" = stalled ]; then
    coproc S { psql -q -X -v ON_ERROR_STOP=1; }
    echo "BEGIN; SET LOCAL application_name = 'stall'; \\echo open" >&"${S[1]}"
    read -r line <&"${S[0]}"
fi
s=$(date +%s.%N)
drain "$v"
e=$(date +%s.%N)
if [ "${2:-}" = stalled ]; then echo '\q' >&"${S[1]}"; wait "$S_PID" || true; fi
left=$(psql -At -X -c "SELECT count(*) FROM exp.t WHERE published_at IS NULL")
hot=$(psql -At -X -c "SELECT n_tup_hot_upd || '/' || n_tup_upd FROM pg_stat_user_tables WHERE relid = 'exp.t'::regclass")
echo "$v${2:+ $2} $(echo "($e - $s) * 1000000 / 100000" | bc -l | cut -c1-5) us/msg, left unpublished $left, HOT updates $hot"
drop

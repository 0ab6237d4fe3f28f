#!/usr/bin/env bash
# drain.sh [ROUNDS] [MESSAGES]: the program users run, `outbox-relay drain` (release, the
# stdout broker into /dev/null), on Postgres tables that keep published rows: a new table of the
# default layout (cursor claims) against one named `?cursor_claims=false` (partial indexes),
# alternated ROUNDS times (default 5). MESSAGES rows (default 100,000) over 1,000 keys are written
# by plain SQL and vacuumed before each drain (not timed). Prints msg/s (the drain's wall time)
# and the share of the drain's updates that were HOT.
#
#   eval "$(scripts/services)"; cargo build --release -p outbox-cli
#   bench/sql/keep-cursor/drain.sh 5
set -euo pipefail
rounds=${1:-5}
n=${2:-100000}
bin=${OUTBOX_RELAY_BIN:-${CARGO_TARGET_DIR:-target}/release/outbox-relay}
db=${PGURL:-postgres://postgres@127.0.0.1:5432/test}
q() { psql -qAt "$db" "$@"; }
for r in $(seq 1 "$rounds"); do
  for layout in default partial; do
    schema="drain_$(date +%s%N)"
    option=""
    [ "$layout" = partial ] && option="?cursor_claims=false"
    "$bin" --store "$db$option" --schema "$schema" migrate > /dev/null 2>&1
    q -c "INSERT INTO \"$schema\".outbox (aggregatetype, aggregateid, type, payload, partition_key)
          SELECT 'order', 'o' || g, 'placed', jsonb_build_object('n', g), 'k' || (g % 1000)
          FROM generate_series(1, $n) g ORDER BY g" -c "VACUUM ANALYZE \"$schema\".outbox" > /dev/null
    start=$(date +%s.%N)
    "$bin" --store "$db$option" --schema "$schema" --broker stdout:// drain > /dev/null 2>&1
    end=$(date +%s.%N)
    hot=$(q -c "SELECT round(100.0 * n_tup_hot_upd / greatest(n_tup_upd, 1), 1)
                FROM pg_stat_user_tables WHERE schemaname = '$schema' AND relname = 'outbox'")
    left=$(q -c "SELECT count(*) FROM \"$schema\".outbox WHERE state <> 'published'")
    printf '%-8s round %d: %6.0f msg/s, %5s%% of updates HOT, %s left\n' \
      "$layout" "$r" "$(echo "$n / ($end - $start)" | bc -l)" "$hot" "$left"
    q -c "DROP SCHEMA \"$schema\" CASCADE" > /dev/null 2>&1
  done
done

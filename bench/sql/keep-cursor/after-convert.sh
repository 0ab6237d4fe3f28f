#!/usr/bin/env bash
# after-convert.sh [HISTORY] [PENDING] [ROUNDS]: what `outbox-relay convert-layout` leaves the
# first drain on a long published history. Each round, alternately:
# - converted: a partial-index table (`?cursor_claims=false`) holding HISTORY published rows
#   (default 2,000,000) and PENDING pending ones (default 100,000) over 1,000 keys, written by
#   plain SQL and vacuumed, converted in place (timed), then drained by `outbox-relay drain` at its
#   defaults (stdout broker into /dev/null); then PENDING more rows and a second drain;
# - fresh: a new table of the default layout holding the PENDING rows alone, drained the same way.
# Prints each drain's wall time and rate, and `outbox-relay status --json`'s time before and
# after. The conversion starts the cursor at the first pending row (an earlier build started it
# below every row, so that the first claims read the whole history once); the second drain
# shows what is left of that.
#
#   eval "$(scripts/services)"; cargo build --release -p outbox-cli
#   bench/sql/keep-cursor/after-convert.sh 2000000 100000 2
set -euo pipefail
hist=${1:-2000000}
n=${2:-100000}
rounds=${3:-2}
bin=${OUTBOX_RELAY_BIN:-${CARGO_TARGET_DIR:-target}/release/outbox-relay}
db=${OUTBOX_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
q() { psql -qAt "$db" "$@"; }
now() { date +%s.%N; }
fill() {
  q -c "INSERT INTO \"$1\".outbox (aggregatetype, aggregateid, type, payload, partition_key)
        SELECT 'order', 'o' || g, 'placed', jsonb_build_object('n', g), 'k' || (g % 1000)
        FROM generate_series(1, $n) g ORDER BY g" -c "VACUUM ANALYZE \"$1\".outbox" > /dev/null
}
# drain SCHEMA LABEL: status, drain, status, timed; one line.
drain() {
  local s0 s1 start end s2 s3 left
  s0=$(now); "$bin" --store "$db" --schema "$1" status --json > /dev/null; s1=$(now)
  start=$(now)
  "$bin" --store "$db" --schema "$1" --broker stdout:// drain > /dev/null 2>&1
  end=$(now)
  s2=$(now); "$bin" --store "$db" --schema "$1" status --json > /dev/null; s3=$(now)
  left=$(q -c "SELECT count(*) FROM \"$1\".outbox WHERE state <> 'published'")
  printf '%-16s %s: status before %.2f s, drain %.2f s (%6.0f msg/s), status after %.2f s, %s left\n' \
    "$2" "$3" "$(echo "$s1 - $s0" | bc -l)" "$(echo "$end - $start" | bc -l)" \
    "$(echo "$n / ($end - $start)" | bc -l)" "$(echo "$s3 - $s2" | bc -l)" "$left"
}
for r in $(seq 1 "$rounds"); do
  schema="conv_$(date +%s%N)"
  "$bin" --store "$db?cursor_claims=false" --schema "$schema" migrate > /dev/null 2>&1
  q -c "INSERT INTO \"$schema\".outbox (aggregatetype, aggregateid, type, payload, partition_key,
                                        state, published_at)
        SELECT 'order', 'h' || g, 'placed', jsonb_build_object('n', g), 'k' || (g % 1000),
               'published', now() - interval '1 hour'
        FROM generate_series(1, $hist) g ORDER BY g"
  fill "$schema"
  c0=$(now)
  "$bin" --store "$db" --schema "$schema" convert-layout > /dev/null 2>&1
  printf 'round %d: convert-layout of %d + %d rows took %.1f s\n' "$r" "$hist" "$n" "$(echo "$(now) - $c0" | bc -l)"
  drain "$schema" "converted, 1st" "round $r"
  fill "$schema"
  drain "$schema" "converted, 2nd" "round $r"
  q -c "DROP SCHEMA \"$schema\" CASCADE" > /dev/null 2>&1
  schema="conv_$(date +%s%N)"
  "$bin" --store "$db" --schema "$schema" migrate > /dev/null 2>&1
  fill "$schema"
  drain "$schema" "fresh" "round $r"
  q -c "DROP SCHEMA \"$schema\" CASCADE" > /dev/null 2>&1
done

#!/usr/bin/env bash
# before-after.sh BEFORE_BIN [ROUNDS] [MESSAGES]: the program users run, `outbox-relay drain`
# (release, the stdout broker into /dev/null), at its defaults on a new Postgres table of the
# default layout, with two builds alternated ROUNDS times (default 5): BEFORE_BIN (e.g. main's
# outbox-relay built in another worktree) against this tree's. MESSAGES rows (default 100,000)
# over 1,000 keys are written by plain SQL and vacuumed before each drain (not timed). Prints
# msg/s (the drain's wall time) and the CPU per message of the relay and of Postgres (the server's
# processes, from /proc, read before and after the drain; it must run on the server's machine).
#
#   eval "$(scripts/services)"; cargo build --release -p outbox-cli
#   bench/sql/keep-cursor/before-after.sh /tmp/outbox-relay-before 5
set -euo pipefail
before=${1:?usage: before-after.sh BEFORE_BIN [ROUNDS] [MESSAGES]}
rounds=${2:-5}
n=${3:-100000}
after=${OUTBOX_RELAY_BIN:-${CARGO_TARGET_DIR:-target}/release/outbox-relay}
db=${PGURL:-postgres://postgres@127.0.0.1:5432/test}
q() { psql -qAt "$db" "$@"; }
# CPU ticks of the server so far: its postmaster's, its exited children's (counted in the
# postmaster's once reaped, as the drain's backends are when it exits) and its live children's.
postmaster=$(head -1 "$(q -c 'SHOW data_directory')/postmaster.pid")
pg_ticks() {
  local total pid
  total=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$postmaster/stat")
  for pid in $(pgrep -P "$postmaster"); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}
hz=$(getconf CLK_TCK)
for r in $(seq 1 "$rounds"); do
  for build in before after; do
    bin=$before
    [ "$build" = after ] && bin=$after
    schema="ba_$(date +%s%N)"
    "$bin" --store "$db" --schema "$schema" migrate > /dev/null 2>&1
    q -c "INSERT INTO \"$schema\".outbox (aggregatetype, aggregateid, type, payload, partition_key)
          SELECT 'order', 'o' || g, 'placed', jsonb_build_object('n', g), 'k' || (g % 1000)
          FROM generate_series(1, $n) g ORDER BY g" -c "VACUUM ANALYZE \"$schema\".outbox" > /dev/null
    children=$(pgrep -P "$postmaster" | wc -l)
    ticks=$(pg_ticks)
    relay_start=$(awk '{print $16 + $17}' /proc/$$/stat)
    start=$(date +%s.%N)
    "$bin" --store "$db" --schema "$schema" --broker stdout:// drain > /dev/null 2>&1
    end=$(date +%s.%N)
    relay=$(( $(awk '{print $16 + $17}' /proc/$$/stat) - relay_start ))
    # The drain's backends exit after it does; their time counts once the postmaster reaps
    # them (up to 5 s).
    for _ in $(seq 50); do
      [ "$(pgrep -P "$postmaster" | wc -l)" -le "$children" ] && break
      sleep 0.1
    done
    used=$(( $(pg_ticks) - ticks ))
    left=$(q -c "SELECT count(*) FROM \"$schema\".outbox WHERE state <> 'published'")
    printf '%-6s round %d: %6.0f msg/s, CPU us/msg: relay %4.1f, Postgres %4.1f; %s left\n' \
      "$build" "$r" "$(echo "$n / ($end - $start)" | bc -l)" \
      "$(echo "$relay * 1000000 / $hz / $n" | bc -l)" "$(echo "$used * 1000000 / $hz / $n" | bc -l)" \
      "$left"
    q -c "DROP SCHEMA \"$schema\" CASCADE" > /dev/null 2>&1
  done
done

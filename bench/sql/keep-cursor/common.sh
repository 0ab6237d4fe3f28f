# Sourced by loop.sh and hazard.sh: the scratch database, a quiet psql, the sketch's table and
# procedures, and the call that drains with variant $1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export PGDATABASE="${PGDATABASE:-test}"
q() { psql -q -X -v ON_ERROR_STOP=1 "$@"; }
# A fresh schema `exp` with the table (today's indexes) and every procedure.
fresh() {
    q -c "SET client_min_messages = warning; DROP SCHEMA IF EXISTS exp CASCADE"
    q -f setup.sql -f proto.sql -f nostate.sql
}
drain() {
    case $1 in
        today) q -c "CALL exp.drain_today(2000)" ;;
        cursor) q -c "CALL exp.drain_cursor(2000, true)" ;;
        unsafe) q -c "CALL exp.drain_cursor(2000, false)" ;;
        nostate) q -c "CALL exp.drain_nostate(2000)" ;;
        *) echo "unknown variant $1" >&2; exit 2 ;;
    esac
}
drop() { q -c "SET client_min_messages = warning; DROP SCHEMA exp CASCADE"; }

#!/usr/bin/env bash
# hazard.sh unsafe|cursor|nostate: does a message whose seq is below rows already drained, and
# whose transaction commits after them, get published? (see README.md)
source "$(dirname "$0")/common.sh"
v=$1
case $v in unsafe|cursor|nostate) ;; *) echo "usage: $0 unsafe|cursor|nostate" >&2; exit 2 ;; esac
fresh
# The late writer: a session of its own, driven step by step.
coproc W { psql -q -X -v ON_ERROR_STOP=1; }
echo "BEGIN; INSERT INTO exp.t (aggregatetype, aggregateid, type, payload, partition_key)
      VALUES ('order', 'late', 'created', '{}', 'late');
      \\echo inserted" >&"${W[1]}"
read -r line <&"${W[0]}"   # its row holds seq 1, not committed
q -c "INSERT INTO exp.t (aggregatetype, aggregateid, type, payload, partition_key)
      SELECT 'order', 'k' || (g % 1000), 'created', '{}', 'k' || (g % 1000)
      FROM generate_series(1, 10000) g"
drain "$v"
echo "COMMIT; \\echo committed" >&"${W[1]}"
read -r line <&"${W[0]}"
echo '\q' >&"${W[1]}"
drain "$v"
psql -At -X -c "SELECT '$v: cursor at ' || (SELECT seq FROM exp.cursor) || ', unpublished '
                       || count(*) FILTER (WHERE published_at IS NULL) || ' (seqs: '
                       || coalesce(string_agg(seq::text, ',') FILTER (WHERE published_at IS NULL), '')
                       || ')' FROM exp.t"
drop

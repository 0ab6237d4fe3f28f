-- The design (docs/keep-cursor.md): `state` in no index nor predicate, so completion (state,
-- published_at, lease, last_error cleared) is a HOT update. Rows that failed, were released or
-- are scheduled are "aside" (their own small indexes, made by loop.sh) and never hold the
-- cursor back. Needs exp.settle from proto.sql.
CREATE OR REPLACE PROCEDURE exp.drain_nostate(batch int) LANGUAGE plpgsql AS $$
DECLARE tok uuid; ids uuid[]; cur bigint;
BEGIN
  LOOP
    SELECT c.seq INTO cur FROM exp.cursor c;
    tok := gen_random_uuid();
    WITH win AS MATERIALIZED (
           SELECT x.tid, x.seq FROM (
             (SELECT w.ctid AS tid, w.seq FROM exp.t w WHERE w.seq >= cur AND w.state = 'pending'
              ORDER BY w.seq LIMIT batch)
             UNION ALL
             (SELECT a.ctid, a.seq FROM exp.t a
              WHERE (a.last_error IS NOT NULL OR a.available_at > a.created_at) AND a.seq < cur
                AND a.state = 'pending' ORDER BY a.seq LIMIT batch)) x
           ORDER BY x.seq LIMIT batch),
         c AS (SELECT ctid FROM exp.t WHERE ctid = ANY(ARRAY(SELECT tid FROM win)) FOR UPDATE SKIP LOCKED),
         u AS (UPDATE exp.t SET lease_token = tok, lease_until = now() + interval '30 s'
               WHERE ctid = ANY(ARRAY(SELECT ctid FROM c)) RETURNING id)
    SELECT array_agg(id) INTO ids FROM u;
    COMMIT;
    EXIT WHEN ids IS NULL;
    UPDATE exp.t SET state = 'published', published_at = now(), lease_token = NULL,
                     lease_until = NULL, last_error = NULL
    WHERE id = ANY(ids) AND lease_token = tok AND state = 'pending';
    COMMIT;
    PERFORM exp.settle(true);
    COMMIT;
  END LOOP;
END $$;

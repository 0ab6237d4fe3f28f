CREATE OR REPLACE PROCEDURE exp.drain_unsafe(batch int) LANGUAGE plpgsql AS $$
DECLARE tok uuid; ids uuid[]; cur bigint;
BEGIN
  LOOP
    SELECT c.seq INTO cur FROM exp.cursor c;
    tok := gen_random_uuid();
    WITH c AS (SELECT ctid FROM exp.t WHERE state = 'pending' AND seq >= cur AND published_at IS NULL
               ORDER BY seq LIMIT batch FOR UPDATE SKIP LOCKED),
         u AS (UPDATE exp.t SET lease_token = tok, lease_until = now() + interval '30 s'
               WHERE ctid = ANY(ARRAY(SELECT ctid FROM c)) RETURNING id)
    SELECT array_agg(id) INTO ids FROM u;
    COMMIT;
    EXIT WHEN ids IS NULL;
    UPDATE exp.t SET published_at = now(), lease_token = NULL, lease_until = NULL
    WHERE id = ANY(ids) AND lease_token = tok AND state = 'pending';
    COMMIT;
    -- The sketch of the last session: min(seq) over the unpublished rows it can see.
    UPDATE exp.cursor SET seq = (SELECT coalesce(min(seq), (SELECT max(seq) + 1 FROM exp.t WHERE seq >= cur))
                                 FROM exp.t WHERE state = 'pending' AND seq >= cur AND published_at IS NULL);
    COMMIT;
  END LOOP;
END $$;

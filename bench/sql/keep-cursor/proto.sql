-- Baseline: today's claim (window of pending rows in seq order, lock, lease) + state completion.
CREATE OR REPLACE PROCEDURE exp.drain_today(batch int) LANGUAGE plpgsql AS $$
DECLARE tok uuid; ids uuid[]; n int;
BEGIN
  LOOP
    tok := gen_random_uuid();
    WITH c AS (SELECT ctid FROM exp.t WHERE state = 'pending' ORDER BY seq LIMIT batch FOR UPDATE SKIP LOCKED),
         u AS (UPDATE exp.t SET lease_token = tok, lease_until = now() + interval '30 s'
               WHERE ctid = ANY(ARRAY(SELECT ctid FROM c)) RETURNING id)
    SELECT array_agg(id) INTO ids FROM u;
    COMMIT;
    EXIT WHEN ids IS NULL;
    UPDATE exp.t SET state = 'published', published_at = now(), lease_token = NULL, lease_until = NULL
    WHERE id = ANY(ids) AND lease_token = tok AND state = 'pending';
    COMMIT;
  END LOOP;
END $$;

-- Cursor: claim from the shard's cursor; HOT completion (published_at only); the cursor moves in
-- two phases: note the sequence's last value L and the transactions alive (virtualxids); once all
-- of those have ended, every seq <= L is settled (committed or rolled back), so the cursor may move
-- to the first unpublished row <= L (or L + 1).
CREATE OR REPLACE PROCEDURE exp.drain_cursor(batch int) LANGUAGE plpgsql AS $$
DECLARE tok uuid; ids uuid[]; cur bigint; l bigint; v text[]; alive bool;
BEGIN
  LOOP
    SELECT c.seq, c.pending_l, c.pending_v INTO cur, l, v FROM exp.cursor c;
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
    -- Settle step.
    IF v IS NOT NULL THEN
      SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' AND virtualxid = ANY(v)) INTO alive;
    END IF;
    IF v IS NULL OR NOT alive THEN
      IF v IS NOT NULL THEN
        SELECT coalesce(min(seq), l + 1) INTO cur FROM exp.t
        WHERE state = 'pending' AND seq >= cur AND seq <= l AND published_at IS NULL;
      END IF;
      UPDATE exp.cursor SET seq = cur,
        pending_l = (SELECT last_value FROM exp.t_seq_seq),
        pending_v = ARRAY(SELECT virtualxid FROM pg_locks WHERE locktype = 'virtualxid'
                          AND pid <> pg_backend_pid());
      COMMIT;
    END IF;
  END LOOP;
END $$;

-- Today's loop, and the cursor's, as plpgsql procedures that commit after every statement (as the
-- relay's calls do). No per-key order check, no shards, nothing published.

-- Today: the claim (window of pending rows in seq order, lock, lease) + the state completion.
CREATE OR REPLACE PROCEDURE exp.drain_today(batch int) LANGUAGE plpgsql AS $$
DECLARE tok uuid; ids uuid[];
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

-- The settle step: the cursor moves in two phases. Note the sequence's last value L and the
-- transactions alive (virtualxids); once all of those have ended, every seq <= L is settled
-- (committed or rolled back), so the cursor may move to the first unpublished row <= L (not
-- counting rows aside when `skip_aside`), or to L + 1. Then note a new point.
CREATE OR REPLACE FUNCTION exp.settle(skip_aside bool) RETURNS void LANGUAGE plpgsql AS $$
DECLARE cur bigint; l bigint; v text[];
BEGIN
  SELECT c.seq, c.pending_l, c.pending_v INTO cur, l, v FROM exp.cursor c;
  IF v IS NOT NULL
     AND EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' AND virtualxid = ANY(v)) THEN
    RETURN;
  END IF;
  IF v IS NOT NULL THEN
    SELECT coalesce(min(seq), l + 1) INTO cur FROM exp.t
    WHERE state = 'pending' AND seq >= cur AND seq <= l AND published_at IS NULL
      AND NOT (skip_aside AND (last_error IS NOT NULL OR available_at > created_at));
  END IF;
  UPDATE exp.cursor SET seq = cur,
    pending_l = (SELECT last_value FROM exp.t_seq_seq),
    pending_v = ARRAY(SELECT virtualxid FROM pg_locks WHERE locktype = 'virtualxid'
                      AND pid <> pg_backend_pid());
END $$;

-- What the first sketch did instead: the cursor moves to the first unpublished row it can see.
-- A row with a lower seq that commits later is left below it for good (hazard.sh).
CREATE OR REPLACE FUNCTION exp.unsafe_advance() RETURNS void LANGUAGE plpgsql AS $$
DECLARE cur bigint;
BEGIN
  SELECT c.seq INTO cur FROM exp.cursor c;
  UPDATE exp.cursor SET seq = (SELECT coalesce(min(seq), (SELECT max(seq) + 1 FROM exp.t WHERE seq >= cur))
                               FROM exp.t WHERE state = 'pending' AND seq >= cur AND published_at IS NULL);
END $$;

-- Cursor: claim from the cursor; HOT completion (published_at only, `state` left alone); then the
-- cursor moves, settled or (`settled` false) the first sketch's way.
CREATE OR REPLACE PROCEDURE exp.drain_cursor(batch int, settled bool) LANGUAGE plpgsql AS $$
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
    IF settled THEN PERFORM exp.settle(false); ELSE PERFORM exp.unsafe_advance(); END IF;
    COMMIT;
  END LOOP;
END $$;

-- A table of the relay's shape (backend-postgres/src/sql.rs) with today's claim indexes, and the
-- cursor's row (the settled seq, and the pending settle: the sequence's last value L and the
-- virtual transaction ids alive when it was read).
CREATE SCHEMA exp;
CREATE TABLE exp.t (
    id uuid NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
    aggregatetype text NOT NULL, aggregateid text NOT NULL, type text NOT NULL,
    payload jsonb NOT NULL, payload_bytes bytea, content_type text,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    partition_key text COLLATE "C", dedup_key text,
    state text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(), lease_token uuid, lease_until timestamptz,
    last_error text, created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz
) WITH (fillfactor = 50);
CREATE UNIQUE INDEX ON exp.t (dedup_key) WHERE dedup_key IS NOT NULL;
CREATE INDEX t_claim ON exp.t (seq) WHERE state = 'pending';
CREATE INDEX ON exp.t (partition_key, seq) WHERE state IN ('pending','dead');
CREATE INDEX ON exp.t (seq) WHERE state = 'dead';
CREATE TABLE exp.cursor (seq bigint NOT NULL, pending_l bigint, pending_v text[]);
INSERT INTO exp.cursor VALUES (0, NULL, NULL);

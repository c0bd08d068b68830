-- Team secrets: values sealed with the store key (ChaCha20-Poly1305, the secret id as
-- associated data), never returned. Names are lower-cased and unique per team. Keep in step
-- with ../sqlite/0005_secrets.sql.
CREATE TABLE secrets (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    name TEXT NOT NULL,
    version BIGINT NOT NULL,
    metadata TEXT NOT NULL,
    value_nonce BYTEA NOT NULL,
    value_sealed BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE UNIQUE INDEX secrets_team_name ON secrets(team_id, name);

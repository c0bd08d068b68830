-- vmon records, PostgreSQL flavour. Times are Unix milliseconds; JSON is TEXT; flags are 0/1.
-- Keep in step with ../sqlite/0001_init.sql: same tables, same columns, same meaning.

CREATE TABLE teams (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    slug TEXT NOT NULL UNIQUE,
    max_concurrent_sandboxes BIGINT NOT NULL,
    max_vcpus BIGINT NOT NULL,
    max_memory_mb BIGINT NOT NULL,
    max_disk_mb BIGINT NOT NULL,
    max_lifetime_secs BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    mask TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    last_used_at BIGINT,
    revoked_at BIGINT
);
CREATE INDEX api_keys_team ON api_keys(team_id);

CREATE TABLE templates (
    id TEXT PRIMARY KEY,
    team_id TEXT,
    kind TEXT NOT NULL,
    source_sandbox_id TEXT,
    public BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    deleted_at BIGINT
);
CREATE INDEX templates_team ON templates(team_id, kind);
CREATE INDEX templates_source ON templates(source_sandbox_id);

CREATE TABLE template_aliases (
    alias TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE
);
CREATE INDEX template_aliases_template ON template_aliases(template_id);

CREATE TABLE builds (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    status TEXT NOT NULL,
    vcpus BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    disk_mb BIGINT NOT NULL,
    envd_version TEXT NOT NULL,
    node_id TEXT,
    created_at BIGINT NOT NULL,
    finished_at BIGINT
);
CREATE INDEX builds_template ON builds(template_id, created_at);

CREATE TABLE template_tags (
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    tag TEXT NOT NULL,
    build_id TEXT NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (template_id, tag)
);

CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    template_id TEXT NOT NULL,
    build_id TEXT NOT NULL,
    paused_build_id TEXT,
    alias TEXT,
    state TEXT NOT NULL,
    node_id TEXT,
    pause_mode TEXT,
    vcpus BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    disk_mb BIGINT NOT NULL,
    envd_version TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    network TEXT,
    auto_pause BIGINT NOT NULL,
    auto_pause_memory BIGINT NOT NULL,
    auto_resume BIGINT NOT NULL,
    timeout_secs BIGINT NOT NULL,
    started_at BIGINT NOT NULL,
    end_at BIGINT NOT NULL,
    envd_access_token TEXT,
    traffic_access_token TEXT,
    extra TEXT NOT NULL,
    fence BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX sandboxes_team ON sandboxes(team_id, started_at, id);
CREATE INDEX sandboxes_expiry ON sandboxes(state, end_at);

CREATE TABLE sandbox_metadata (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, key)
);
CREATE INDEX sandbox_metadata_pair ON sandbox_metadata(key, value);

CREATE TABLE events (
    seq BIGSERIAL PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    event_data TEXT,
    sandbox_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    build_id TEXT NOT NULL,
    team_id TEXT NOT NULL,
    template_id TEXT NOT NULL,
    timestamp BIGINT NOT NULL
);
CREATE INDEX events_team ON events(team_id, seq);
CREATE INDEX events_sandbox ON events(sandbox_id, seq);
CREATE INDEX events_time ON events(timestamp);

CREATE TABLE webhooks (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    name TEXT NOT NULL,
    url TEXT NOT NULL,
    enabled BIGINT NOT NULL,
    events TEXT NOT NULL,
    secret_nonce BYTEA NOT NULL,
    secret_sealed BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX webhooks_team ON webhooks(team_id);

CREATE TABLE webhook_deliveries (
    id TEXT PRIMARY KEY,
    webhook_id TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    delivery_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    status_code BIGINT,
    success BIGINT NOT NULL,
    duration_ms BIGINT NOT NULL,
    error TEXT,
    created_at BIGINT NOT NULL
);
CREATE INDEX webhook_deliveries_webhook ON webhook_deliveries(webhook_id, created_at);

CREATE TABLE outbox (
    seq BIGSERIAL PRIMARY KEY,
    webhook_id TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    delivery_id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    claimed_by TEXT,
    claimed_epoch BIGINT,
    claimed_until BIGINT,
    done_at BIGINT
);
CREATE INDEX outbox_pending ON outbox(done_at, seq);

CREATE TABLE fences (
    name TEXT PRIMARY KEY,
    epoch BIGINT NOT NULL
);

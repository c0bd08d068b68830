-- Template builds of the Template SDK: the request and its state (JSON the api owns), the log
-- entries in order, and the layer cache (a step prefix's key -> the build made after it).
-- Keep in step with ../postgres/0003_template_builds.sql.
CREATE TABLE template_builds (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    team_id TEXT NOT NULL,
    status TEXT NOT NULL,
    doc TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX template_builds_template ON template_builds(template_id, created_at);
CREATE INDEX template_builds_status ON template_builds(status);

CREATE TABLE template_build_logs (
    build_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (build_id, seq)
);

CREATE TABLE template_layers (
    team_id TEXT NOT NULL,
    cache_key TEXT NOT NULL,
    doc TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    used_at BIGINT NOT NULL,
    PRIMARY KEY (team_id, cache_key)
);

-- What the api decides cold boot vs memory restore from, and the build a build was captured
-- on top of. Keep in step with ../sqlite/0002_build_memory.sql.
ALTER TABLE builds ADD COLUMN has_memory BIGINT NOT NULL DEFAULT 1;
ALTER TABLE builds ADD COLUMN parent_build_id TEXT;

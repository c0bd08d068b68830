-- Named persistent volumes, unique by name within a team. Their files live outside the store
-- (the volumes directory); a row is the volume's existence. Keep in step with
-- ../sqlite/0004_volumes.sql.
CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE UNIQUE INDEX volumes_team_name ON volumes(team_id, name);

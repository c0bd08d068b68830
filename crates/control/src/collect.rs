//! The collector of node builds that no record names: the checkpoint build of a fork or
//! snapshot that crashed before its record, the build of a template or sandbox whose record
//! went just before a crash, a pause superseded by a kill, a template build replaced while a
//! sandbox still ran from it.
//!
//! A build is *named* by a sandbox record (the build it runs or is paused on, and the build it
//! owns), by a tag of a template or snapshot of any team or of none (the shared templates), and
//! by the template layer cache. Nothing else makes a sandbox start from a build: a template
//! build's own history (`TemplateBuild::result`) is read by nothing, and the store's table of
//! builds ever tagged is provenance. Builds other builds were made from need no name: a node
//! build record lists every artifact it needs (its memory base and layers, its whole disk
//! chain), so a child never reads its parent's record and the node's sweep keeps whatever a
//! remaining record names. What a running sandbox stands on (its memory basis: the build it
//! restored from, or its latest checkpoint) the node refuses to delete (`BuildInUse`); the
//! collector leaves it for a later pass.
//!
//! Two passes. At a restart of `vmon up` the api runs it before it serves anything (in
//! `recovery.rs`): nothing is in flight, every unnamed build goes. The KV leader of a single
//! node runs it again every hour (`reaper.rs`); transitions are in flight then, and some make a
//! build before any record names it (a fork's checkpoint stays unnamed until its first child's
//! record; a template build's layers until the cache entry; a pause until its commit). Those
//! transitions hold no lock the collector could take (a fork's children are launched after the
//! source's lock is released, template builds take none), so the periodic pass relies on age
//! instead: it leaves every build whose node record is younger than [`COLLECT_GRACE`], and it
//! lists the node's builds *before* it reads the records, so a build whose record commits in
//! between is seen named. A transition that takes longer than the grace between the node's
//! record and its own is the one it could race; none comes close (the gaps are milliseconds,
//! a fork's first child a few seconds).
//!
//! In a cluster neither pass runs yet: each node's builds would be compared with the records of
//! every replica, and builds only in the object store collected too (a later issue).

use std::collections::HashSet;
use std::time::Duration;

use vmon_proto::node::NodeError;

use super::Control;

/// How old (since its node record was written) an unnamed build must be before the periodic
/// pass deletes it.
pub const COLLECT_GRACE: Duration = Duration::from_secs(3600);

impl Control {
    /// Every build a record names (see the module's docs). Fails rather than answer with part
    /// of the names: a partial answer would delete named builds.
    pub(crate) async fn named_builds(&self) -> anyhow::Result<HashSet<String>> {
        let mut named = HashSet::new();
        for rec in self.records.sandboxes(None).await? {
            named.insert(rec.build.build_id);
            named.extend(rec.owned_build);
        }
        // The shared templates (no team: `""` matches none), then each team's templates and
        // snapshots.
        let mut templates = self.records.templates_of("").await?;
        for team in self.records.teams().await? {
            templates.extend(self.records.templates_of(&team.id).await?);
            templates.extend(self.records.snapshots(&team.id).await?);
        }
        for t in templates {
            named.extend(t.tags.into_values().map(|b| b.build_id));
        }
        for (_, _, b) in self.records.layers().await? {
            named.insert(b.build_id);
        }
        Ok(named)
    }

    /// Deletes the node's builds that no record names and whose node record is at least
    /// `grace` old (`Duration::ZERO`: all of them, for the restart pass). Returns the ids
    /// deleted; a build the node refuses (a running sandbox stands on it) is kept.
    pub async fn collect_builds(&self, grace: Duration) -> anyhow::Result<Vec<String>> {
        // The node's list first, the names second (see the module's docs).
        let kept = self.node.builds().await?;
        let named = self.named_builds().await?;
        let now = u64::try_from(time::OffsetDateTime::now_utc().unix_timestamp()).unwrap_or(0);
        let mut deleted = Vec::new();
        for k in kept {
            let id = k.build.build_id;
            if named.contains(&id) || now.saturating_sub(k.recorded_unix) < grace.as_secs() {
                continue;
            }
            match self.node.delete_build(&id).await {
                Ok(()) => {
                    tracing::info!(build_id = %id, "a build no record names: deleted");
                    deleted.push(id);
                }
                Err(NodeError::BuildInUse(_)) => {
                    tracing::debug!(build_id = %id, "an unnamed build a running sandbox stands on: kept for now");
                }
                Err(NodeError::BuildNotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(build_id = %id, error = %e, "deleting an unnamed build failed")
                }
            }
        }
        Ok(deleted)
    }

    /// The leader's periodic pass (single node only; see the module's docs).
    pub(crate) async fn collect_builds_periodically(&self) {
        if self.cluster.is_some() {
            return;
        }
        if let Err(e) = self.collect_builds(COLLECT_GRACE).await {
            tracing::warn!(error = %e, "collecting unnamed builds failed");
        }
    }
}

//! Templates and the transitions that make builds of a running sandbox: fork and snapshot.

use std::collections::BTreeMap;
use std::sync::Arc;

use time::OffsetDateTime;
use vmon_proto::node::{BuildInfo, TemplateSpec};

use super::{event, record_error, Control};
use super::{ControlError, ControlResult};
use crate::ids;
use crate::records::{
    Change, EventKind, SandboxRecord, SandboxState, Team, TemplateKind, TemplateRecord,
};

pub const DEFAULT_TAG: &str = "default";

/// A parsed template reference: `[namespace/]name[:tag]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRef {
    pub namespace: Option<String>,
    pub name: String,
    pub tag: Option<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A snapshot's name as asked (`[namespace/]alias[:tag]`, the namespace the team's); none
/// when blank.
fn snapshot_name(team: &Team, name: Option<&str>) -> ControlResult<Option<TemplateRef>> {
    let Some(n) = name.map(str::trim).filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    let r = parse_template_ref(n).ok_or_else(|| {
        ControlError::bad_request(format!(
            "invalid snapshot name {n:?}: use [namespace/]alias[:tag]"
        ))
    })?;
    if r.namespace.as_ref().is_some_and(|ns| *ns != team.slug) {
        return Err(ControlError::bad_request(format!(
            "the namespace of a snapshot name must be the team's ({})",
            team.slug
        )));
    }
    Ok(Some(r))
}

pub fn parse_template_ref(s: &str) -> Option<TemplateRef> {
    let (namespace, rest) = match s.split_once('/') {
        Some((ns, rest)) => (Some(ns), rest),
        None => (None, s),
    };
    let (name, tag) = match rest.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (rest, None),
    };
    if !valid_name(name)
        || namespace.is_some_and(|n| !valid_name(n))
        || tag.is_some_and(|t| !valid_name(t))
    {
        return None;
    }
    Some(TemplateRef {
        namespace: namespace.map(str::to_string),
        name: name.to_string(),
        tag: tag.map(str::to_string),
    })
}

impl Control {
    /// A create's `templateID`: a template id, an alias, `namespace/name:tag`, or a snapshot id.
    pub async fn resolve_template(
        &self,
        team: &Team,
        reference: &str,
    ) -> ControlResult<(TemplateRecord, String, BuildInfo)> {
        let not_found = || ControlError::not_found(format!("template '{reference}' not found"));
        let r = parse_template_ref(reference.trim()).ok_or_else(not_found)?;
        let mut template = self.find_template(team, &r).await?;
        if template.is_none() && r.namespace.is_none() && super::builtin::builtin(&r.name).is_some()
        {
            // Still building in the background (or never built here): wait for it.
            self.ensure_builtin(&r.name).await.map_err(|e| {
                ControlError::unavailable(format!(
                    "template '{reference}' could not be built: {e:#}"
                ))
            })?;
            template = self.find_template(team, &r).await?;
        }
        let template = template.ok_or_else(not_found)?;
        let tag = r.tag.unwrap_or_else(|| DEFAULT_TAG.to_string());
        let build = template.tags.get(&tag).cloned().ok_or_else(not_found)?;
        Ok((template, tag, build))
    }

    async fn find_template(
        &self,
        team: &Team,
        r: &TemplateRef,
    ) -> ControlResult<Option<TemplateRecord>> {
        let visible = |t: &TemplateRecord| t.team_id.as_ref().is_none_or(|o| *o == team.id);
        if let Some(ns) = &r.namespace {
            // Only the team's own namespace names anything.
            if *ns != team.slug {
                return Ok(None);
            }
        }
        if let Some(t) = self
            .records
            .template_by_id(&r.name)
            .await
            .map_err(record_error)?
        {
            if visible(&t) {
                return Ok(Some(t));
            }
        }
        let t = self
            .records
            .template_by_alias(&team.id, &r.name)
            .await
            .map_err(record_error)?;
        Ok(t.filter(|t| visible(t) && (r.namespace.is_none() || t.team_id.is_some())))
    }

    /// Builds the shared template `alias` on the node unless it exists.
    pub async fn ensure_template(
        &self,
        alias: &str,
        spec: &crate::config::BaseTemplate,
    ) -> anyhow::Result<BuildInfo> {
        self.ensure_template_with(alias, spec, None, None, None)
            .await
    }

    /// [`Self::ensure_template`] with the template's start and ready commands and its warm
    /// request ([`TemplateSpec::warm_request`]).
    pub async fn ensure_template_with(
        &self,
        alias: &str,
        spec: &crate::config::BaseTemplate,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        warm_request: Option<String>,
    ) -> anyhow::Result<BuildInfo> {
        // One build of a builtin at a time across api replicas; a replica that waited here
        // then finds it built.
        let guard = self
            .kv
            .lock(
                &format!("builtin/{alias}"),
                std::time::Duration::from_secs(3600),
            )
            .await?;
        let result = self
            .ensure_template_locked(alias, spec, start_cmd, ready_cmd, warm_request)
            .await;
        let _ = guard.unlock().await;
        result
    }

    async fn ensure_template_locked(
        &self,
        alias: &str,
        spec: &crate::config::BaseTemplate,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        warm_request: Option<String>,
    ) -> anyhow::Result<BuildInfo> {
        let existing = self.records.template_by_alias("", alias).await?;
        if let Some(t) = existing.filter(|t| t.team_id.is_none()) {
            if let Some(b) = t.tags.get(DEFAULT_TAG) {
                match self.node.build_info(&b.build_id).await {
                    Ok(info) if !info.older_image => return Ok(info),
                    // Sandboxes and snapshots made from the old build keep it.
                    Ok(_) => tracing::info!(
                        alias,
                        "template built from an older guest image: building it again"
                    ),
                    Err(e) => {
                        tracing::warn!(alias, error = %e, "template build missing on the node: rebuilding")
                    }
                }
            }
        }
        tracing::info!(
            alias,
            vcpus = spec.vcpus,
            memory_mb = spec.memory_mb,
            "building template (first start; this takes a while)"
        );
        let info = self
            .node
            .build_template(TemplateSpec {
                build_id: ids::build_id(),
                vcpus: spec.vcpus,
                memory_mb: spec.memory_mb,
                disk_mb: spec.disk_mb,
                start_cmd,
                ready_cmd,
                warm_request,
                env_vars: BTreeMap::new(),
                image: None,
                layer: super::builtin::builtin(alias)
                    .and_then(|b| b.layer)
                    .map(str::to_string),
            })
            .await?;
        let id = match self.records.template_by_alias("", alias).await? {
            Some(t) if t.team_id.is_none() => t.id,
            _ => ids::template_id(),
        };
        self.records
            .put_template(TemplateRecord {
                id,
                team_id: None,
                alias: Some(alias.to_string()),
                kind: TemplateKind::Template,
                tags: BTreeMap::from([(DEFAULT_TAG.to_string(), info.clone())]),
                created_at: OffsetDateTime::now_utc(),
            })
            .await?;
        tracing::info!(alias, build_id = %info.build_id, "template ready");
        Ok(info)
    }

    /// Fork: checkpoint the running source once, then start `count` children from it.
    pub async fn fork(
        self: &Arc<Self>,
        team: &Team,
        id: &str,
        timeout: u64,
        count: u32,
    ) -> ControlResult<Vec<ControlResult<SandboxRecord>>> {
        if count == 0 || count > 100 || count >= team.limits.max_concurrent {
            return Err(ControlError::bad_request(format!(
                "count must be between 1 and 100 and lower than the team's concurrent-sandbox limit ({})",
                team.limits.max_concurrent
            )));
        }
        if timeout > team.limits.max_lifetime_secs {
            return Err(ControlError::bad_request(
                "timeout is longer than the team's maximum lifetime",
            ));
        }
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let checkpointed = async {
            let rec = self.owned(team, id).await?;
            if rec.state == SandboxState::Paused {
                // The children start from the paused state (memory and disk, as it was
                // paused); the source stays paused and untouched, and keeps its build.
                let build = rec.build.clone();
                return ControlResult::Ok((rec, build, false));
            }
            let build = self
                .node
                .checkpoint(
                    &rec.id,
                    &rec.execution_id,
                    super::gpus::memory_capture(&rec, true).0,
                )
                .await?;
            let ev = event(
                &rec,
                EventKind::Checkpointed,
                serde_json::json!({ "reason": "fork", "build_id": build.build_id, "count": count }),
            );
            self.commit(
                Change::Checkpoint {
                    sandbox_id: rec.id.clone(),
                    execution_id: rec.execution_id.clone(),
                    template: None,
                },
                ev,
                guard.fence().token(),
            )
            .await?;
            Ok((rec, build, true))
        }
        .await;
        let _ = guard.unlock().await;
        let (source, build, owns_build) = checkpointed?;
        let children = (0..count).map(|_| {
            let control = self.clone();
            let (team, source, build) = (team.clone(), source.clone(), build.clone());
            tokio::spawn(async move {
                control
                    .launch_child(&team, &source, &build, timeout, owns_build)
                    .await
            })
        });
        let results: Vec<ControlResult<SandboxRecord>> = futures::future::join_all(children)
            .await
            .into_iter()
            .map(|child| {
                child.unwrap_or_else(|e| {
                    Err(ControlError::internal(format!(
                        "fork child task failed: {e}"
                    )))
                })
            })
            .collect();
        if !results.iter().any(Result::is_ok) && owns_build {
            self.drop_build(&build.build_id).await;
        }
        Ok(results)
    }

    /// Snapshot: the running sandbox becomes a template (named or not) and keeps running.
    pub async fn snapshot(
        &self,
        team: &Team,
        id: &str,
        name: Option<&str>,
        memory: bool,
    ) -> ControlResult<SnapshotNames> {
        let named = snapshot_name(team, name)?;
        let existing = self.snapshot_room(team, named.as_ref()).await?;
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let rec = self.owned(team, id).await?;
            if rec.state != SandboxState::Running {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is paused; only a running sandbox can be snapshotted"
                )));
            }
            // A mount's state is outside the guest's memory, a GPU's in no snapshot: the disk
            // only.
            let (memory, skipped) = super::gpus::memory_capture(&rec, memory);
            let build = self.node.checkpoint(&rec.id, &rec.execution_id, memory).await?;
            let tag = named
                .as_ref()
                .and_then(|r| r.tag.clone())
                .unwrap_or_else(|| DEFAULT_TAG.to_string());
            let mut template = existing.unwrap_or_else(|| TemplateRecord {
                id: ids::template_id(),
                team_id: Some(team.id.clone()),
                alias: named.as_ref().map(|r| r.name.clone()),
                kind: TemplateKind::Snapshot {
                    source_sandbox_id: rec.id.clone(),
                },
                tags: BTreeMap::new(),
                created_at: OffsetDateTime::now_utc(),
            });
            template.kind = TemplateKind::Snapshot {
                source_sandbox_id: rec.id.clone(),
            };
            template.created_at = OffsetDateTime::now_utc();
            let replaced = template.tags.insert(tag.clone(), build.clone());
            let info = snapshot_info(team, &template, &tag);
            let mut data = serde_json::json!({ "reason": "snapshot", "snapshot_id": info.snapshot_id, "build_id": build.build_id });
            if let Some(why) = skipped {
                data["memory_skipped"] = why.into();
            }
            let ev = event(&rec, EventKind::Checkpointed, data);
            // The snapshot's template and its event commit together.
            self.commit(
                Change::Checkpoint {
                    sandbox_id: rec.id.clone(),
                    execution_id: rec.execution_id.clone(),
                    template: Some(Box::new(template)),
                },
                ev,
                guard.fence().token(),
            )
            .await?;
            if let Some(old) = replaced {
                self.drop_build(&old.build_id).await;
            }
            Ok(info)
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Whether the team may keep one more snapshot under `named`: the snapshot template that
    /// name already has (a new tag of it adds no snapshot), else room under
    /// `quotas.max_snapshots`; a name a template holds is a conflict.
    async fn snapshot_room(
        &self,
        team: &Team,
        named: Option<&TemplateRef>,
    ) -> ControlResult<Option<TemplateRecord>> {
        let existing = match named {
            Some(r) => {
                let t = self
                    .records
                    .template_by_alias(&team.id, &r.name)
                    .await
                    .map_err(record_error)?;
                match t {
                    Some(t)
                        if t.team_id.as_deref() == Some(team.id.as_str())
                            && matches!(t.kind, TemplateKind::Snapshot { .. }) =>
                    {
                        Some(t)
                    }
                    Some(_) => {
                        return Err(ControlError::conflict(format!(
                            "the name {:?} is used by a template",
                            r.name
                        )))
                    }
                    None => None,
                }
            }
            None => None,
        };
        if existing.is_some() {
            return Ok(existing);
        }
        let max = self.config.quotas.max_snapshots;
        let kept = self
            .records
            .snapshots(&team.id)
            .await
            .map_err(record_error)?
            .len();
        if kept >= max {
            return Err(ControlError::too_many(format!(
                "the team already keeps {kept} snapshots, its most (quotas.max_snapshots); delete one first"
            )));
        }
        Ok(None)
    }

    /// `GET /snapshots`: newest first, one entry per tag.
    pub async fn list_snapshots(
        &self,
        team: &Team,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> ControlResult<Vec<SnapshotNames>> {
        let mut out = Vec::new();
        for t in self
            .records
            .snapshots(&team.id)
            .await
            .map_err(record_error)?
        {
            let TemplateKind::Snapshot { source_sandbox_id } = &t.kind else {
                continue;
            };
            if sandbox_id.is_some_and(|s| s != source_sandbox_id) {
                continue;
            }
            for tag in t.tags.keys() {
                let info = snapshot_info(team, &t, tag);
                if let Some(n) = name {
                    let matches = t.alias.as_deref() == Some(n)
                        || info.snapshot_id == n
                        || info.names.iter().any(|x| x == n);
                    if !matches {
                        continue;
                    }
                }
                out.push(info);
            }
        }
        Ok(out)
    }

    /// `DELETE /templates/{id}`: a team's snapshot (one tag of it when the id names a tag).
    pub async fn delete_template(&self, team: &Team, reference: &str) -> ControlResult<()> {
        let not_found = || ControlError::not_found(format!("template '{reference}' not found"));
        let r = parse_template_ref(reference.trim()).ok_or_else(not_found)?;
        let mut t = self.find_template(team, &r).await?.ok_or_else(not_found)?;
        if t.team_id.as_deref() != Some(team.id.as_str()) {
            return Err(not_found());
        }
        let removed: Vec<BuildInfo> = match &r.tag {
            Some(tag) if t.tags.len() > 1 => {
                let b = t.tags.remove(tag).ok_or_else(not_found)?;
                self.records.put_template(t).await.map_err(record_error)?;
                vec![b]
            }
            Some(tag) if !t.tags.contains_key(tag) => return Err(not_found()),
            _ => {
                self.records
                    .delete_template(&t.id)
                    .await
                    .map_err(record_error)?;
                if let Err(e) = self.records.delete_template_builds(&t.id).await {
                    tracing::warn!(template = %t.id, error = %e, "deleting the template's build records failed");
                }
                t.tags.into_values().collect()
            }
        };
        for b in removed {
            self.drop_build(&b.build_id).await;
        }
        Ok(())
    }
}

/// How a snapshot is named: its id, and the names it can be started by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotNames {
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// `snapshotID` is `<slug>/<alias>:<tag>` for named snapshots, `<templateID>:<tag>` otherwise.
fn snapshot_info(team: &Team, t: &TemplateRecord, tag: &str) -> SnapshotNames {
    match &t.alias {
        Some(alias) => {
            let full = format!("{}/{alias}:{tag}", team.slug);
            SnapshotNames {
                snapshot_id: full.clone(),
                names: vec![full],
            }
        }
        None => SnapshotNames {
            snapshot_id: format!("{}:{tag}", t.id),
            names: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_refs() {
        assert_eq!(
            parse_template_ref("team/snap:v1"),
            Some(TemplateRef {
                namespace: Some("team".into()),
                name: "snap".into(),
                tag: Some("v1".into())
            })
        );
        assert_eq!(
            parse_template_ref("base").map(|r| (r.namespace, r.tag)),
            Some((None, None))
        );
        for bad in ["", "a/b/c", "a:", ":x", "a b", "x/", "a:b:c"] {
            assert_eq!(parse_template_ref(bad), None, "{bad:?}");
        }
    }
}

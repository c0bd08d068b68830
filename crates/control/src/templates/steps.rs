//! The steps of a template build as the Template SDK sends them (`POST /v2/templates/{id}/
//! builds/{buildID}`), checked before anything runs, and what each becomes in the build VM:
//! a shell command with the user, working directory and environment the steps before it set.

use std::collections::BTreeMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::{ControlError, ControlResult};

/// The trigger's body (`TemplateBuildStartV2`); unknown keys are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BuildStart {
    pub steps: Vec<Step>,
    pub force: bool,
    pub from_image: Option<String>,
    pub from_template: Option<String>,
    pub from_image_registry: Option<RegistryLogin>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// `fromImageRegistry` as sent (a password or a cloud key in it): held in memory for the build
/// only, and its `Debug` shows nothing of it.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct RegistryLogin(pub serde_json::Value);

impl std::fmt::Debug for RegistryLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RegistryLogin([redacted])")
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Step {
    #[serde(rename = "type")]
    pub kind: String,
    pub args: Vec<String>,
    pub force: bool,
    pub files_hash: Option<String>,
    pub force_upload: Option<bool>,
}

/// The image `from_base_image()` names: vmon's own base.
pub const BASE_IMAGE: &str = "e2bdev/base";
/// Most steps one build may have.
const MAX_STEPS: usize = 256;
/// Longest argument a step may carry.
const MAX_ARG: usize = 64 << 10;

/// What the steps so far have set: the next step runs with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepState {
    pub user: String,
    pub workdir: Option<String>,
    pub env: BTreeMap<String, String>,
}

impl Default for StepState {
    fn default() -> Self {
        StepState {
            user: "user".into(),
            workdir: None,
            env: BTreeMap::new(),
        }
    }
}

/// A checked step: what to run in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `bash -l -c cmd` as `user`.
    Run { cmd: String, user: String },
    /// Extract the uploaded archive `files_hash` and place `src` at `dest`.
    Copy {
        files_hash: String,
        src: String,
        dest: String,
        owner: String,
        mode: Option<String>,
    },
    /// Only the state changes (ENV, USER, WORKDIR), plus for USER/WORKDIR a command that
    /// makes the user or the directory.
    State { cmd: Option<String> },
}

fn bad(n: usize, msg: impl std::fmt::Display) -> ControlError {
    ControlError::bad_request(format!("step {n}: {msg}"))
}

pub fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn valid_user(u: &str) -> bool {
    !u.is_empty()
        && u.len() <= 32
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !u.starts_with('-')
}

/// `'…'` for bash.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Checks every step; returns the action of each and the state after each.
pub fn plan(start: &BuildStart) -> ControlResult<Vec<(Action, StepState)>> {
    if start.steps.len() > MAX_STEPS {
        return Err(ControlError::bad_request(format!(
            "a build has at most {MAX_STEPS} steps"
        )));
    }
    let mut state = StepState::default();
    let mut out = Vec::with_capacity(start.steps.len());
    for (i, step) in start.steps.iter().enumerate() {
        let action = action(i + 1, step, &mut state)?;
        out.push((action, state.clone()));
    }
    Ok(out)
}

/// Step `n`'s action; `state` becomes the state after it.
fn action(n: usize, step: &Step, state: &mut StepState) -> ControlResult<Action> {
    if step
        .args
        .iter()
        .any(|a| a.len() > MAX_ARG || a.contains('\0'))
    {
        return Err(bad(n, "an argument is too long or holds a NUL byte"));
    }
    match step.kind.as_str() {
        "RUN" => run_action(n, step, state),
        "COPY" => copy_action(n, step, state),
        "ENV" => env_action(n, step, state),
        "WORKDIR" => workdir_action(n, step, state),
        "USER" => user_action(n, step, state),
        other => Err(bad(
            n,
            format!("unknown step type {other:?} (RUN, COPY, ENV, WORKDIR and USER are known)"),
        )),
    }
}

/// RUN command [user]: the command as the step's user, else the current one.
fn run_action(n: usize, step: &Step, state: &StepState) -> ControlResult<Action> {
    let cmd = step
        .args
        .first()
        .filter(|c| !c.trim().is_empty())
        .ok_or_else(|| bad(n, "RUN needs a command"))?
        .clone();
    let user = match step.args.get(1).filter(|u| !u.is_empty()) {
        Some(u) if valid_user(u) => u.clone(),
        Some(u) => return Err(bad(n, format!("{u:?} is not a user name"))),
        None => state.user.clone(),
    };
    Ok(Action::Run { cmd, user })
}

/// COPY src dest [owner] [mode]: `src` relative inside the uploaded context, `dest` in the
/// working directory unless absolute, owned by the current user unless an owner is given.
fn copy_action(n: usize, step: &Step, state: &StepState) -> ControlResult<Action> {
    let files_hash = step
        .files_hash
        .clone()
        .filter(|h| is_hash(h))
        .ok_or_else(|| bad(n, "COPY needs the filesHash of its uploaded files"))?
        .to_ascii_lowercase();
    let src = step.args.first().cloned().unwrap_or_default();
    let dest = step.args.get(1).cloned().unwrap_or_default();
    if src.is_empty() || src.starts_with('/') || src.split('/').any(|p| p == "..") {
        return Err(bad(
            n,
            format!("COPY source {src:?} must be relative, inside the context"),
        ));
    }
    if dest.is_empty() {
        return Err(bad(n, "COPY needs a destination"));
    }
    let owner = match step.args.get(2).filter(|u| !u.is_empty()) {
        Some(u) => {
            let (usr, grp) = u.split_once(':').unwrap_or((u, u));
            if !valid_user(usr) || !valid_user(grp) {
                return Err(bad(n, format!("{u:?} is not an owner")));
            }
            format!("{usr}:{grp}")
        }
        None => format!("{0}:{0}", state.user),
    };
    let mode = match step.args.get(3).filter(|m| !m.is_empty()) {
        Some(m) if m.len() <= 4 && m.bytes().all(|b| (b'0'..=b'7').contains(&b)) => Some(m.clone()),
        Some(m) => return Err(bad(n, format!("{m:?} is not an octal mode"))),
        None => None,
    };
    Ok(Action::Copy {
        files_hash,
        src,
        dest: in_workdir(state, &dest),
        owner,
        mode,
    })
}

/// ENV name value [name value …]: variables of later steps and of the template's sandboxes.
fn env_action(n: usize, step: &Step, state: &mut StepState) -> ControlResult<Action> {
    if !step.args.len().is_multiple_of(2) {
        return Err(bad(n, "ENV takes name, value pairs"));
    }
    for kv in step.args.chunks(2) {
        let k = &kv[0];
        let ok = !k.is_empty()
            && !k.as_bytes()[0].is_ascii_digit()
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(bad(n, format!("{k:?} is not a variable name")));
        }
        state.env.insert(k.clone(), kv[1].clone());
    }
    Ok(Action::State { cmd: None })
}

/// WORKDIR dir: the working directory of later steps, made (owned by the current user).
fn workdir_action(n: usize, step: &Step, state: &mut StepState) -> ControlResult<Action> {
    let dir = step
        .args
        .first()
        .filter(|d| !d.is_empty())
        .ok_or_else(|| bad(n, "WORKDIR needs a directory"))?;
    let dir = in_workdir(state, dir);
    state.workdir = Some(dir.clone());
    Ok(Action::State {
        cmd: Some(format!(
            "mkdir -p {d} && chown {u}:{u} {d} 2>/dev/null || true",
            d = quote(&dir),
            u = state.user
        )),
    })
}

/// USER name: the user of later steps, made when the guest lacks it.
fn user_action(n: usize, step: &Step, state: &mut StepState) -> ControlResult<Action> {
    let u = step
        .args
        .first()
        .filter(|u| valid_user(u))
        .ok_or_else(|| bad(n, "USER needs a user name"))?;
    state.user = u.clone();
    Ok(Action::State {
        cmd: Some(format!(
            "id -u {u} >/dev/null 2>&1 || useradd -m -s /bin/bash {u}"
        )),
    })
}

/// `path` as is when absolute, else under the working directory (the user's home when none
/// was set).
fn in_workdir(state: &StepState, path: &str) -> String {
    if path.starts_with('/') {
        return path.to_string();
    }
    let base = state
        .workdir
        .clone()
        .unwrap_or_else(|| home_of(&state.user));
    format!("{}/{path}", base.trim_end_matches('/'))
}

pub fn home_of(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// The layer cache's key after a step: the key before it and everything that decides what
/// the step does (its type, arguments, files and the state it runs in).
pub fn next_key(prev: &str, step: &Step, before: &StepState) -> String {
    let mut h = Sha256::new();
    h.update(prev.as_bytes());
    h.update(b"\0");
    h.update(step.kind.as_bytes());
    for a in &step.args {
        h.update(b"\0");
        h.update(a.as_bytes());
    }
    h.update(b"\0files:");
    h.update(step.files_hash.as_deref().unwrap_or("").as_bytes());
    h.update(b"\0user:");
    h.update(before.user.as_bytes());
    h.update(b"\0workdir:");
    h.update(before.workdir.as_deref().unwrap_or("").as_bytes());
    for (k, v) in &before.env {
        h.update(b"\0env:");
        h.update(k.as_bytes());
        h.update(b"=");
        h.update(v.as_bytes());
    }
    hex::encode(h.finalize())
}

/// The key of the finished template: the last step's key and the start and ready commands.
pub fn final_key(prev: &str, start: &BuildStart, state: &StepState) -> String {
    let mut h = Sha256::new();
    h.update(prev.as_bytes());
    h.update(b"\0start:");
    h.update(start.start_cmd.as_deref().unwrap_or("").as_bytes());
    h.update(b"\0ready:");
    h.update(start.ready_cmd.as_deref().unwrap_or("").as_bytes());
    h.update(b"\0user:");
    h.update(state.user.as_bytes());
    h.update(b"\0workdir:");
    h.update(state.workdir.as_deref().unwrap_or("").as_bytes());
    hex::encode(h.finalize())
}

/// The script a COPY runs as root once its archive is at `archive` in the guest: extract it
/// in a scratch directory, then place each match of `src` (a glob allowed) at `dest` the way
/// Docker's COPY does (a directory's contents into `dest`; a file into `dest` when that ends
/// in `/`, is a directory or the glob matched several entries, else as `dest`), then owner
/// and mode.
pub fn copy_script(
    archive: &str,
    src: &str,
    dest: &str,
    owner: &str,
    mode: Option<&str>,
) -> String {
    let chmod = match mode {
        Some(m) => format!("chmod -R {m} \"$t\""),
        None => ":".into(),
    };
    format!(
        r#"set -euo pipefail
s=$(mktemp -d)
trap 'rm -rf "$s" {archive}' EXIT
tar -xf {archive} -C "$s"
src={src}
dest={dest}
shopt -s nullglob dotglob
IFS=''
matches=( "$s"/$src )
unset IFS
if [ ${{#matches[@]}} -eq 0 ]; then echo "COPY: nothing matches $src" >&2; exit 1; fi
for m in "${{matches[@]}}"; do
  if [ -d "$m" ] && [ ! -L "$m" ]; then
    mkdir -p "$dest"; cp -a "$m"/. "$dest"/; t="$dest"
  elif [[ "$dest" == */ ]] || [ -d "$dest" ] || [ ${{#matches[@]}} -gt 1 ]; then
    mkdir -p "$dest"; cp -a "$m" "$dest"/; t="${{dest%/}}/$(basename "$m")"
  else
    mkdir -p "$(dirname "$dest")"; cp -a "$m" "$dest"; t="$dest"
  fi
  chown -R {owner} "$t"
  {chmod}
done
"#,
        archive = quote(archive),
        src = quote(src),
        dest = quote(dest),
        owner = quote(owner),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> Step {
        Step {
            kind: kind.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn state_flows_through_the_steps() {
        let start = BuildStart {
            steps: vec![
                step("ENV", &["A", "1", "B", "two"]),
                step("WORKDIR", &["/app"]),
                step("USER", &["root"]),
                step("RUN", &["echo $A"]),
                step("RUN", &["whoami", "user"]),
            ],
            ..Default::default()
        };
        let p = plan(&start).expect("test value");
        assert_eq!(p[3].1.env.get("B").map(String::as_str), Some("two"));
        assert_eq!(p[3].1.workdir.as_deref(), Some("/app"));
        assert_eq!(
            p[3].0,
            Action::Run {
                cmd: "echo $A".into(),
                user: "root".into()
            }
        );
        assert_eq!(
            p[4].0,
            Action::Run {
                cmd: "whoami".into(),
                user: "user".into()
            }
        );
    }

    #[test]
    fn bad_steps_are_refused_with_their_number() {
        for (s, want) in [
            (step("FROM", &["x"]), "step 1: unknown step type"),
            (
                step("COPY", &["a", "/b"]),
                "step 1: COPY needs the filesHash",
            ),
            (step("ENV", &["A"]), "step 1: ENV takes"),
            (step("RUN", &[""]), "step 1: RUN needs"),
            (step("USER", &["a b"]), "step 1: USER needs"),
        ] {
            let e = plan(&BuildStart {
                steps: vec![s],
                ..Default::default()
            })
            .expect_err("an error");
            assert!(e.to_string().starts_with(want), "{e} vs {want}");
        }
        let mut c = step("COPY", &["../etc", "/b"]);
        c.files_hash = Some("a".repeat(64));
        assert!(plan(&BuildStart {
            steps: vec![c],
            ..Default::default()
        })
        .is_err());
    }

    #[test]
    fn relative_copy_lands_in_the_workdir_or_home() {
        let mut c = step("COPY", &["f.txt", "dir/f.txt", "", ""]);
        c.files_hash = Some("b".repeat(64));
        let p = plan(&BuildStart {
            steps: vec![c.clone()],
            ..Default::default()
        })
        .expect("test value");
        match &p[0].0 {
            Action::Copy { dest, owner, .. } => {
                assert_eq!(dest, "/home/user/dir/f.txt");
                assert_eq!(owner, "user:user");
            }
            a => panic!("{a:?}"),
        }
    }

    #[test]
    fn keys_change_with_any_input() {
        let s = StepState::default();
        let a = next_key("base", &step("RUN", &["echo 1"]), &s);
        assert_eq!(a, next_key("base", &step("RUN", &["echo 1"]), &s));
        assert_ne!(a, next_key("base", &step("RUN", &["echo 2"]), &s));
        assert_ne!(a, next_key("other", &step("RUN", &["echo 1"]), &s));
        let mut s2 = s.clone();
        s2.env.insert("X".into(), "1".into());
        assert_ne!(a, next_key("base", &step("RUN", &["echo 1"]), &s2));
    }
}

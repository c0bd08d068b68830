//! Shared templates the api makes by itself: `base` (built in the background from the first
//! start on; until it is built every create answers 503 saying how far the build is) and
//! `code-interpreter-v1` (built in the background after it, or on the first create that names
//! it; a create that arrives during the build waits for it), and `desktop` (built on the first
//! create that names it; `crate::desktop` says why).

use vmon_proto::node::BuildInfo;
use vmon_proto::progress::Phase;

use super::Control;
use super::{ControlError, ControlResult};

/// The template every other build starts from.
pub const BASE: &str = "base";
/// What the first build is called in progress messages.
pub const BASE_BUILD: &str = "the base template";

/// The `e2b-code-interpreter` SDK's default template.
pub const CODE_INTERPRETER: &str = "code-interpreter-v1";

/// Where the image puts the server's entry (`crates/image/assets/code_interpreter.py`; its
/// package, `code_interpreter/`, is beside it).
const CODE_INTERPRETER_PY: &str = "/usr/local/lib/vmon/code_interpreter.py";

/// A shared template the api knows how to build.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub alias: &'static str,
    pub start_cmd: Option<&'static str>,
    pub ready_cmd: Option<&'static str>,
    /// The pool's warm request (`port/path`, [`vmon_proto::node::TemplateSpec::warm_request`]).
    pub warm_request: Option<&'static str>,
    /// The node's layer the template boots instead of the base image
    /// ([`vmon_proto::node::TemplateSpec::layer`]).
    pub layer: Option<&'static str>,
    /// At least this much memory, whatever the base template's.
    pub min_memory_mb: u32,
}

const CODE_INTERPRETER_BUILTIN: Builtin = Builtin {
    alias: CODE_INTERPRETER,
    start_cmd: Some(
        "cd /home/user && exec python3 /usr/local/lib/vmon/code_interpreter.py \
         >>/tmp/code-interpreter.log 2>&1",
    ),
    ready_cmd: Some(
        "python3 -c 'import urllib.request; \
         urllib.request.urlopen(\"http://127.0.0.1:49999/health\", timeout=5)'",
    ),
    // An uncounted cell through the default kernel in every warmed pool process, so a new
    // sandbox's first `run_code` finds IPython's paths translated.
    warm_request: Some("49999/warm"),
    layer: None,
    min_memory_mb: 0,
};

/// Every builtin, in the order [`BuiltinLocks`] keeps their locks.
const BUILTINS: [Builtin; 2] = [CODE_INTERPRETER_BUILTIN, crate::desktop::DESKTOP_BUILTIN];

/// The builtin template named `alias` (built on demand), if there is one.
pub fn builtin(alias: &str) -> Option<Builtin> {
    BUILTINS.into_iter().find(|b| b.alias == alias)
}

/// One lock per builtin, held while it is built in this process: a caller that arrives during
/// a build of the same builtin waits for it and then finds it built, while builds of different
/// builtins never wait for each other (a first `desktop` create does not queue behind the
/// background build of `code-interpreter-v1`; docs/architecture.md, "Builtin templates build
/// apart").
#[derive(Default)]
pub(crate) struct BuiltinLocks([tokio::sync::Mutex<()>; BUILTINS.len()]);

impl Control {
    /// Builds `base` unless it exists, reporting to [`Control::startup`]; once it succeeds the
    /// platform is ready and creates are admitted. A failure is reported there too (creates
    /// then say so) and the caller may try again.
    pub async fn ensure_base(&self) -> anyhow::Result<BuildInfo> {
        let p = &self.startup;
        // An in-process node may already be reporting its image build: leave its step be.
        if p.phase() == Phase::Failed || p.current_step() == "starting" {
            p.step("base template");
            p.update("waiting for the node", None);
        }
        match self.ensure_template(BASE, &self.config.base_template).await {
            Ok(info) => {
                p.ready();
                Ok(info)
            }
            Err(e) => {
                p.failed(format!("{e:#}"));
                Err(e)
            }
        }
    }

    /// 503 with the first build's progress until `base` is built.
    pub(crate) fn admit_while_starting(&self) -> ControlResult<()> {
        if self.startup.is_ready() {
            return Ok(());
        }
        let s = self.startup.snapshot();
        let mut message = s.message();
        if s.phase == Phase::Building {
            message.push_str("; retry shortly");
        }
        Err(ControlError::unavailable(message))
    }

    /// Builds the builtin template `alias` unless it exists; one build of each builtin at a
    /// time ([`BuiltinLocks`]), so a caller that arrives during its build waits for it and then
    /// finds it built.
    pub async fn ensure_builtin(&self, alias: &str) -> anyhow::Result<BuildInfo> {
        let i = BUILTINS
            .iter()
            .position(|b| b.alias == alias)
            .ok_or_else(|| anyhow::anyhow!("no builtin template {alias:?}"))?;
        let b = BUILTINS[i];
        debug_assert!(b.start_cmd.is_none_or(
            |c| c.contains(CODE_INTERPRETER_PY) || c.contains(crate::desktop::DESKTOP_START)
        ));
        let _same_builtin = self.builtin_builds.0[i].lock().await;
        let mut spec = self.config.base_template.clone();
        spec.memory_mb = spec.memory_mb.max(b.min_memory_mb);
        self.ensure_template_with(
            b.alias,
            &spec,
            b.start_cmd.map(str::to_string),
            b.ready_cmd.map(str::to_string),
            b.warm_request.map(str::to_string),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_interpreter_is_builtin() {
        let b = builtin("code-interpreter-v1").expect("builtin");
        assert!(b.start_cmd.is_some_and(|c| c.contains(CODE_INTERPRETER_PY)));
        assert!(b.ready_cmd.is_some_and(|c| c.contains("49999/health")));
        assert!(builtin("base").is_none());
    }

    #[tokio::test]
    async fn builtins_lock_apart() {
        let locks = BuiltinLocks::default();
        let ci = BUILTINS.iter().position(|b| b.alias == CODE_INTERPRETER);
        let desktop = BUILTINS
            .iter()
            .position(|b| b.alias == crate::desktop::DESKTOP);
        let (Some(ci), Some(desktop)) = (ci, desktop) else {
            panic!("both are builtins");
        };
        let _building = locks.0[ci].lock().await;
        assert!(locks.0[desktop].try_lock().is_ok());
        assert!(locks.0[ci].try_lock().is_err());
    }
}

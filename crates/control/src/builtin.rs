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

/// The builtin template named `alias` (built on demand), if there is one.
pub fn builtin(alias: &str) -> Option<Builtin> {
    [CODE_INTERPRETER_BUILTIN, crate::desktop::DESKTOP_BUILTIN]
        .into_iter()
        .find(|b| b.alias == alias)
}

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

    /// Builds the builtin template `alias` unless it exists; one builtin build at a time, so
    /// a caller that arrives during a build waits for it and then finds it built.
    pub async fn ensure_builtin(&self, alias: &str) -> anyhow::Result<BuildInfo> {
        let b = builtin(alias).ok_or_else(|| anyhow::anyhow!("no builtin template {alias:?}"))?;
        debug_assert!(b.start_cmd.is_none_or(
            |c| c.contains(CODE_INTERPRETER_PY) || c.contains(crate::desktop::DESKTOP_START)
        ));
        let _one_at_a_time = self.builtin_builds.lock().await;
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
}

//! Why a sandbox was paused or resumed: the `reason` and `trigger` its events carry.

use time::OffsetDateTime;

/// Why a sandbox is paused (`reason` of its paused event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PauseWhy {
    Request,
    Timeout,
    /// Its idle policy: suspended until then, when it ends.
    Idle {
        until: OffsetDateTime,
    },
}

impl PauseWhy {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PauseWhy::Request => "request",
            PauseWhy::Timeout => "timeout",
            PauseWhy::Idle { .. } => "idle",
        }
    }
}

/// What asked for a resume (`trigger` of its resumed event and of the health's last resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResumeTrigger {
    Connect,
    Traffic,
}

impl ResumeTrigger {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ResumeTrigger::Connect => "connect",
            ResumeTrigger::Traffic => "traffic",
        }
    }
}

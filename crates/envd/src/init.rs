//! PID 1 mode: the guest's init. Owned by the VM layer (boot issue); the agent's server lives
//! in the rest of this crate.

/// Runs as the guest's init: never returns.
pub fn run() -> anyhow::Result<()> {
    anyhow::bail!("init mode is not built yet")
}

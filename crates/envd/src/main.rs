fn main() -> anyhow::Result<()> {
    if std::process::id() == 1 || std::env::args().nth(1).as_deref() == Some("init") {
        return vmon_envd::init::run();
    }
    anyhow::bail!("server mode is not built yet")
}

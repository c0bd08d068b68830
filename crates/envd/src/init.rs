//! PID 1 mode: the guest's init.
//!
//! It mounts the kernel filesystems, names the host, brings up `lo` and `eth0` (address and
//! gateway from the kernel command line: `vmon.ip=` and `vmon.gw=`), writes what login shells
//! need to know of the CPU ([`CPU_PROFILE`]), then runs the envd server
//! as its child and restarts it if it dies. As PID 1 it reaps every orphan the kernel hands it,
//! and on SIGTERM (or SIGINT, the kernel's ctrl-alt-del) it stops everything, syncs and powers
//! the machine off.
//!
//! The server runs in a child rather than in this process so that init's `waitpid(-1)` never
//! steals the exit status of a process the server is waiting for.

use std::ffi::CString;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::mount::MountFlags;

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Written once per boot, sourced by the image's `/etc/profile.d/vmon-cpu.sh` (so a login
/// shell, which every SDK command runs in, does not read `/proc/cpuinfo` itself). A restored
/// snapshot keeps the file of the boot it was taken in, as its kernel keeps that boot's
/// `/proc/cpuinfo`: the two always agree.
pub const CPU_PROFILE: &str = "/run/vmon/cpu.sh";

/// Rewritten by the envd server after every `/init` (create, resume, a fork's child): the code
/// interpreter's server keeps a token it checked with envd until this file changes.
pub const INIT_MARKER: &str = "/run/vmon/envd-init";

static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_shutdown_signal(_sig: libc::c_int) {
    SHUTDOWN.store(true, Ordering::SeqCst);
}

fn log(level: &str, msg: &str) {
    // One JSON line on the console, like the server's own logs.
    let line = serde_json::json!({"level": level, "logger": "init", "msg": msg});
    println!("{line}");
}

fn mount(src: &str, target: &str, fstype: &str, flags: MountFlags, data: &str) {
    let _ = std::fs::create_dir_all(target);
    let Ok(data) = CString::new(data) else {
        return;
    };
    if let Err(err) = rustix::mount::mount(src, target, fstype, flags, data.as_c_str()) {
        if err != rustix::io::Errno::BUSY {
            log("warn", &format!("mount {fstype} on {target}: {err}"));
        }
    }
}

fn is_mounted(target: &str) -> bool {
    std::fs::read_to_string("/proc/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(target))
        })
        .unwrap_or(false)
}

/// Remounts `/` with `flags` (read-write when empty).
fn remount_root(flags: MountFlags) {
    if let Err(err) = rustix::mount::mount_remount("/", flags, "") {
        log("warn", &format!("remounting / ({flags:?}): {err}"));
    }
}

fn mount_all() {
    let nosuid_nodev = MountFlags::NOSUID | MountFlags::NODEV;
    if !is_mounted("/proc") {
        mount(
            "proc",
            "/proc",
            "proc",
            nosuid_nodev | MountFlags::NOEXEC,
            "",
        );
    }
    if !is_mounted("/sys") {
        mount(
            "sysfs",
            "/sys",
            "sysfs",
            nosuid_nodev | MountFlags::NOEXEC,
            "",
        );
    }
    if !is_mounted("/dev") {
        mount(
            "devtmpfs",
            "/dev",
            "devtmpfs",
            MountFlags::NOSUID,
            "mode=0755",
        );
    }
    if !is_mounted("/dev/pts") {
        mount(
            "devpts",
            "/dev/pts",
            "devpts",
            MountFlags::NOSUID | MountFlags::NOEXEC,
            "gid=5,mode=620,ptmxmode=666",
        );
    }
    if !is_mounted("/dev/shm") {
        mount("tmpfs", "/dev/shm", "tmpfs", nosuid_nodev, "mode=1777");
    }
    if !is_mounted("/run") {
        mount("tmpfs", "/run", "tmpfs", nosuid_nodev, "mode=0755");
    }
    if !is_mounted("/sys/fs/cgroup") {
        mount(
            "cgroup2",
            "/sys/fs/cgroup",
            "cgroup2",
            nosuid_nodev | MountFlags::NOEXEC,
            "",
        );
    }
    let _ = std::os::unix::fs::symlink("/proc/self/fd", "/dev/fd");
    let _ = std::os::unix::fs::symlink("/proc/self/fd/0", "/dev/stdin");
    let _ = std::os::unix::fs::symlink("/proc/self/fd/1", "/dev/stdout");
    let _ = std::os::unix::fs::symlink("/proc/self/fd/2", "/dev/stderr");
    // The root may have come up read-only from the initramfs.
    remount_root(MountFlags::empty());
}

/// The `OPENBLAS_CORETYPE` this CPU needs, from `/proc/cpuinfo`'s text: under TCG the guest CPU
/// is `qemu64` (AMD family 15 without SSSE3), which OpenBLAS takes for an Opteron and gives
/// 3DNow! kernels TCG lacks; its SSE3 kernels (`Prescott`) are right there. A CPU with SSSE3
/// (KVM's models) keeps OpenBLAS's own choice. Only the first `flags` line counts.
pub fn openblas_coretype(cpuinfo: &str) -> Option<&'static str> {
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags"))?;
    let (_, list) = flags.split_once(':')?;
    (!list.split_whitespace().any(|f| f == "ssse3")).then_some("Prescott")
}

/// The shell text of [`CPU_PROFILE`] for `cpuinfo`.
pub fn cpu_profile(cpuinfo: &str) -> String {
    let mut s = String::from("# vmon: written by envd's init at boot, from /proc/cpuinfo.\n");
    if let Some(t) = openblas_coretype(cpuinfo) {
        s.push_str(&format!("export OPENBLAS_CORETYPE={t}\n"));
    }
    s
}

/// Writes [`CPU_PROFILE`] (a temporary file renamed into place, so a shell never reads half).
/// Without `/proc/cpuinfo` no file is written and the profile script reads the CPU itself.
fn write_cpu_profile() {
    let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
        log(
            "warn",
            "no /proc/cpuinfo: login shells will read it themselves",
        );
        return;
    };
    let path = std::path::Path::new(CPU_PROFILE);
    let tmp = path.with_extension("tmp");
    let r = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, cpu_profile(&cpuinfo)))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        log("warn", &format!("writing {CPU_PROFILE}: {e}"));
    }
}

fn set_hostname(name: &str) {
    // SAFETY: pointer and length describe `name`'s bytes.
    unsafe {
        libc::sethostname(name.as_ptr().cast(), name.len());
    }
}

fn cmdline_value(cmdline: &str, key: &str) -> Option<String> {
    cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .map(String::from)
}

fn ip(args: &[&str]) {
    match Command::new("ip").args(args).env("PATH", PATH).status() {
        Ok(s) if s.success() => {}
        Ok(s) => log("warn", &format!("ip {}: {s}", args.join(" "))),
        Err(e) => log("warn", &format!("ip {}: {e}", args.join(" "))),
    }
}

fn network() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    ip(&["link", "set", "lo", "up"]);
    if let Some(addr) = cmdline_value(&cmdline, "vmon.ip") {
        ip(&["addr", "add", &addr, "dev", "eth0"]);
        ip(&["link", "set", "eth0", "up"]);
        if let Some(gw) = cmdline_value(&cmdline, "vmon.gw") {
            ip(&["route", "add", "default", "via", &gw]);
        }
    }
}

fn install_signal_handlers() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGPWR] {
        // SAFETY: a zeroed sigaction with a plain handler that only stores an atomic; no
        // SA_RESTART so a blocking waitpid returns EINTR and the loop sees the flag.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_shutdown_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = 0;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    // SAFETY: asks the kernel to send SIGINT to init on ctrl-alt-del instead of rebooting.
    unsafe {
        libc::reboot(libc::RB_DISABLE_CAD);
    }
}

fn spawn_server() -> Option<u32> {
    let exe = std::env::current_exe().unwrap_or_else(|_| "/usr/local/bin/envd".into());
    match Command::new(exe)
        .args(["--init-marker", INIT_MARKER])
        .env_clear()
        .env("PATH", PATH)
        .env("HOME", "/root")
        .env("LANG", "C.UTF-8")
        .current_dir("/")
        .spawn()
    {
        Ok(c) => {
            log("info", &format!("envd server started as pid {}", c.id()));
            Some(c.id())
        }
        Err(e) => {
            log("error", &format!("cannot start envd server: {e}"));
            None
        }
    }
}

fn power_off() -> ! {
    log("info", "stopping all processes");
    // SAFETY: signalling every process but init; no memory is touched.
    unsafe {
        libc::kill(-1, libc::SIGTERM);
    }
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: as above.
    unsafe {
        libc::kill(-1, libc::SIGKILL);
        libc::sync();
    }
    remount_root(MountFlags::RDONLY);
    // SAFETY: as above.
    unsafe {
        libc::sync();
    }
    log("info", "power off");
    // SAFETY: ends the machine; nothing runs after this.
    unsafe {
        libc::reboot(libc::RB_POWER_OFF);
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Runs as the guest's init: never returns.
pub fn run() -> anyhow::Result<()> {
    std::env::set_var("PATH", PATH);
    mount_all();
    write_cpu_profile();
    set_hostname("sandbox");
    install_signal_handlers();
    network();
    log("info", "init ready");
    let mut server = spawn_server();
    loop {
        if SHUTDOWN.load(Ordering::SeqCst) {
            power_off();
        }
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer; reaps any child (orphans included).
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid <= 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ECHILD) {
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        if Some(pid as u32) == server {
            log(
                "warn",
                &format!("envd server exited (status {status}); restarting"),
            );
            std::thread::sleep(Duration::from_millis(200));
            server = spawn_server();
        }
    }
}

/// Mounts the virtio-fs share `tag` at `path` (made first, like infra's `mkdir -p`), unless
/// something is mounted there already (a repeated `/init`). `nosuid,nodev`: what another
/// sandbox wrote into a shared volume must not raise privileges in this one.
pub fn mount_volume(tag: &str, path: &str) -> Result<(), String> {
    if is_mounted(path) {
        return Ok(());
    }
    // The cloud kernel has virtio-fs as a module; nothing loads it without udev.
    if !std::path::Path::new("/sys/module/virtiofs").exists() {
        let status = std::process::Command::new("/sbin/modprobe")
            .arg("virtiofs")
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            return Err(format!("loading the virtiofs module failed: {status:?}"));
        }
    }
    std::fs::create_dir_all(path).map_err(|e| format!("creating {path}: {e}"))?;
    // No options: a null data pointer.
    rustix::mount::mount(
        tag,
        path,
        "virtiofs",
        MountFlags::NOSUID | MountFlags::NODEV,
        None,
    )
    .map_err(|e| format!("mount -t virtiofs {tag} {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QEMU64: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu pse sse sse2 pni syscall nx lm\n\nprocessor\t: 1\nflags\t\t: fpu ssse3\n";
    const EPYC: &str = "processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 avx2\n";

    #[test]
    fn a_cpu_without_ssse3_gets_prescott_kernels() {
        assert_eq!(openblas_coretype(QEMU64), Some("Prescott"));
        assert_eq!(
            cpu_profile(QEMU64).lines().last(),
            Some("export OPENBLAS_CORETYPE=Prescott")
        );
    }

    #[test]
    fn a_cpu_with_ssse3_keeps_openblas_choice() {
        assert_eq!(openblas_coretype(EPYC), None);
        assert!(!cpu_profile(EPYC).contains("export"));
        // A flag that only starts with ssse3 is not ssse3, and no flags line decides nothing.
        assert_eq!(openblas_coretype("flags : ssse3x\n"), Some("Prescott"));
        assert_eq!(openblas_coretype("processor : 0\n"), None);
        assert!(!cpu_profile("").contains("export"));
    }
}

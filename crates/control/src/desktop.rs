//! The `desktop` builtin template: what the `e2b-desktop` SDKs (Python 2.7.2, JS 2.4.0) create
//! by default. It boots the node's desktop layer (`vmon_image::desktop`: the base tree plus
//! Xvfb, xfce4, x11vnc, noVNC, xdotool, scrot, xrandr, xdg-utils and Firefox ESR) and its start
//! command brings the desktop up on display `:0`, so the template's memory snapshot is taken
//! with it running and a create is a restore.
//!
//! It is built on the first create that names it, not at `vmon up`'s start like
//! `code-interpreter-v1`: its layer is a second disk of about 3 GB made with apt on the host,
//! which most installations never use, and a build in the background would compete with the
//! first sandboxes for the machine's cores.

use crate::Builtin;

/// The `e2b-desktop` SDKs' default template.
pub const DESKTOP: &str = "desktop";

/// The layer's start script (`crates/image/assets/desktop/start`, installed by
/// `vmon_image::desktop`).
pub const DESKTOP_START: &str = "/usr/local/lib/vmon/desktop/start";

pub const DESKTOP_BUILTIN: Builtin = Builtin {
    alias: DESKTOP,
    start_cmd: Some("exec /usr/local/lib/vmon/desktop/start"),
    // What the SDKs wait for after their `startxfce4`, and the desktop's window mapped; a
    // failed check says what is missing (the build's error carries the last one).
    ready_cmd: Some(
        "for p in Xvfb xfce4-session xfwm4 xfdesktop xfce4-panel; do \
         pgrep -x $p >/dev/null || { echo \"$p is not running\" >&2; exit 1; }; done; \
         DISPLAY=:0 xdotool search --onlyvisible --class xfdesktop >/dev/null \
         || { echo 'no xfdesktop window yet' >&2; exit 1; }",
    ),
    warm_request: None,
    layer: Some(vmon_proto::node::LAYER_DESKTOP),
    // Firefox and the session beside it; the snapshot holds only what the guest touched.
    min_memory_mb: 1536,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn desktop_is_builtin() {
        let b = crate::builtin(DESKTOP).expect("builtin");
        assert!(b.start_cmd.is_some_and(|c| c.contains(DESKTOP_START)));
        assert_eq!(b.layer, Some("desktop"));
        assert!(b.min_memory_mb >= 1024);
    }
}

# NOT COLLECTED YET (named so pytest skips the file): not yet run to its end. Session 43 ran it
# against its own `vmon up` (VMON_E2E_EXTERNAL=1) on a host at load 19-27 (2 cores shared by five
# engineers): the first create built the template (659 s: tree and disk cached, boot, xfce4
# ready) and test_create, test_mouse, test_keyboard and test_screenshots passed. In
# test_launch_open_and_window_queries `launch("xfce4-terminal")` made its window (found, titled),
# then `get_current_window_id()` (`xdotool getwindowfocus`) after `xdotool windowactivate` exited
# -1 with no output: not yet understood. The rest (open, the stream in Chromium,
# pause/resume/fork, the JS test) did not run. Rename to test_desktop.py once the file passes.
"""Desktop sandboxes with the official `e2b-desktop` SDK (tests/requirements.txt) against
`vmon up`: the `desktop` builtin template (docs/templates.md) restores a running xfce4 desktop;
create with a resolution and dpi, screenshots, every mouse and keyboard call checked against the
events an X client sees (`xev`), window queries, open/launch, the noVNC stream opened in headless
Chromium through vmon's proxy over https with the local CA, and pause/resume and fork with a
browser window open.

The first create builds the template (its layer is made with apt on the host, then booted and
snapshotted: docs/templates.md gives the times); the others are restores."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from e2b import CommandExitException
from e2b_desktop import Sandbox as Desktop
from PIL import Image

from conftest import wait_for

# The first create waits for the template's build.
FIRST_CREATE_TIMEOUT = 2400
W, H, DPI = 1280, 800, 120
CHROMIUM = os.environ.get("VMON_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("VMON_CHROMEDRIVER", "/usr/bin/chromedriver")
SCREENSHOTS = Path(os.environ.get("VMON_SCREENSHOT_DIR", "/var/tmp/vmon-e2e/screenshots"))
# An X client that prints every event it gets; stdbuf so its log is written as they come.
XEV = "stdbuf -oL xev -geometry 500x400+100+100 -event mouse -event keyboard -event button"


@pytest.fixture(scope="module")
def desktop(vmon):
    t0 = time.monotonic()
    d = Desktop.create(resolution=(W, H), dpi=DPI, timeout=1800, request_timeout=FIRST_CREATE_TIMEOUT)
    print(f"first Desktop.create (the template's build included): {time.monotonic() - t0:.0f} s")
    try:
        yield d
    finally:
        d.kill()


def png(data) -> Image.Image:
    raw = bytes(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", raw[:16]
    im = Image.open(io.BytesIO(raw))
    assert im.format == "PNG"
    return im.convert("RGB")


def colors(im: Image.Image) -> int:
    return len(set(im.resize((160, 100)).getdata()))


def changed(a: Image.Image, b: Image.Image, box: tuple[int, int, int, int]) -> int:
    """How many pixels of `box` differ between two screenshots."""
    pa, pb = a.crop(box).getdata(), b.crop(box).getdata()
    return sum(1 for x, y in zip(pa, pb) if x != y)


def windows(d: Desktop, application: str) -> list[str]:
    """The SDK's get_application_windows, none when there is none (xdotool's search then exits
    1, which the SDK raises, as on E2B)."""
    try:
        return [w for w in d.get_application_windows(application) if w]
    except CommandExitException:
        return []


def xev_log(d: Desktop) -> str:
    return d.commands.run("cat /tmp/xev.log").stdout


def events(d: Desktop, kind: str) -> list[str]:
    """The `kind` events xev printed, each with its detail line(s)."""
    blocks = xev_log(d).split("\n\n")
    return [b for b in blocks if b.startswith(kind)]


def start_xev(d: Desktop) -> str:
    """xev's window (it sets no WM_CLASS, so it is found by its title); its events go to
    /tmp/xev.log."""
    d.commands.run("pkill -x xev; rm -f /tmp/xev.log")
    d.commands.run(f"{XEV} >/tmp/xev.log 2>&1", background=True, timeout=0).disconnect()

    def found():
        r = d.commands.run("xdotool search --onlyvisible --name '^Event Tester$' || true")
        return r.stdout.split()

    return wait_for(found, timeout=60, what="xev's window")[0]


def test_create_restores_a_running_desktop_of_the_asked_size(desktop):
    assert desktop.get_screen_size() == (W, H)
    r = desktop.commands.run("xdpyinfo | grep resolution")
    assert f"{DPI}x{DPI} dots per inch" in r.stdout, r.stdout
    # The session is the one the template's snapshot holds: the SDK's `Xvfb` and `startxfce4`
    # resized it and left it be (one session, one X server).
    assert desktop.commands.run("pgrep -c -x xfce4-session").stdout.strip() == "1"
    assert desktop.commands.run("pgrep -c -x Xvfb").stdout.strip() == "1"
    im = png(desktop.screenshot())
    assert im.size == (W, H)
    assert colors(im) > 20, "the screenshot is blank"
    # A second desktop is a restore: time it (create plus what the SDK runs).
    t0 = time.monotonic()
    other = Desktop.create(resolution=(800, 600), timeout=300)
    try:
        took = time.monotonic() - t0
        assert other.get_screen_size() == (800, 600)
        assert png(other.screenshot()).size == (800, 600)
        print(f"Desktop.create from the template: {took:.1f} s")
    finally:
        other.kill()


def test_mouse_moves_clicks_drags_and_scrolls(desktop):
    win = start_xev(desktop)
    desktop.move_mouse(300, 250)
    assert desktop.get_cursor_position() == (300, 250)
    # To where it already is, and to the screen's last pixel: `xdotool mousemove --sync` returns.
    desktop.move_mouse(300, 250)
    desktop.move_mouse(W - 1, H - 1)
    assert desktop.get_cursor_position() == (W - 1, H - 1)

    desktop.left_click(200, 200)
    desktop.right_click(210, 200)
    desktop.middle_click(220, 200)
    desktop.double_click(230, 200)
    desktop.scroll("up", 2)
    desktop.scroll("down", 3)
    desktop.drag((150, 150), (350, 300))

    def buttons():
        found = [re.search(r"button (\d+)", b) for b in events(desktop, "ButtonPress")]
        return [int(m.group(1)) for m in found if m]

    want = [1, 3, 2, 1, 1, 4, 4, 5, 5, 5, 1]
    assert wait_for(lambda: buttons() == want or None, timeout=30, what=f"presses {want}: {buttons()}")
    releases = events(desktop, "ButtonRelease")
    # The drag ends where it was asked to.
    assert "root:(350,300)" in releases[-1], releases[-1]
    assert desktop.get_current_window_id() == win


def test_keyboard_writes_presses_and_hotkeys(desktop):
    win = start_xev(desktop)
    desktop.left_click(300, 300)
    desktop.write("Hi 2u!")
    desktop.press("enter")
    desktop.press(["ctrl", "a"])
    desktop.press("F5")

    def keysyms():
        found = [re.search(r"keysym 0x[0-9a-f]+, (\w+)\)", b) for b in events(desktop, "KeyPress")]
        return [m.group(1) for m in found if m]

    want = ["H", "i", "space", "2", "u", "exclam", "Return", "Control_L", "a", "F5"]
    # `write` types shifted characters with Shift presses of its own around them.
    assert wait_for(
        lambda: [k for k in keysyms() if k not in ("Shift_L", "Shift_R")] == want or None,
        timeout=60,
        what=f"keys {want}: {keysyms()}",
    )
    assert desktop.get_current_window_id() == win


def stop_xev(d: Desktop) -> None:
    d.commands.run("pkill -x xev || true")
    wait_for(
        lambda: not d.commands.run("xdotool search --onlyvisible --name '^Event Tester$' || true").stdout.strip(),
        timeout=30,
        what="xev's window to go",
    )
    time.sleep(1)  # the desktop repainted where it was


def test_screenshots_change_after_input(desktop):
    stop_xev(desktop)
    before = png(desktop.screenshot())
    win = start_xev(desktop)
    assert desktop.get_window_title(win) == "Event Tester"
    after = png(desktop.screenshot())
    assert changed(before, after, (100, 100, 600, 500)) > 10_000, "xev's window is not on the screenshot"
    # A right click on the desktop opens xfdesktop's menu: the pixels under it change.
    stop_xev(desktop)
    desktop.move_mouse(W - 300, H - 300)
    base = png(desktop.screenshot())
    desktop.right_click(W - 300, H - 300)

    def menu():
        shot = png(desktop.screenshot())
        return shot if changed(base, shot, (0, 0, W, H)) > 2_000 else None

    assert wait_for(menu, timeout=60, what="the desktop's menu").size == (W, H)
    desktop.press("escape")


def test_launch_open_and_window_queries(desktop):
    desktop.launch("xfce4-terminal")

    def terminal():
        for w in windows(desktop, "xfce4-terminal"):
            if "Terminal" in desktop.get_window_title(w):
                return w
        return None

    term = wait_for(terminal, timeout=120, what="the terminal's window")
    desktop.commands.run(f"xdotool windowactivate --sync {term}")
    # GTK gives the input focus to a window of the terminal's own (not always the titled one).
    assert desktop.get_current_window_id() in desktop.get_application_windows("xfce4-terminal")
    desktop.commands.run("pkill -f xfce4-terminal || true")

    page = open_page(desktop)
    assert "vmon desktop page" in desktop.get_window_title(page)


def open_page(d: Desktop) -> str:
    """Firefox on a page of the sandbox's (open of a URL: xdg-open); its window's id. A window
    already showing the page is reused (Firefox's start under TCG is the slow part)."""
    for w in windows(d, "firefox"):
        if "vmon desktop page" in d.get_window_title(w):
            return w
    d.files.write("/home/user/site/index.html", "<title>vmon desktop page</title><h1>Hello desktop</h1>")
    d.commands.run("cd /home/user/site && python3 -m http.server 8000 >/dev/null 2>&1", background=True, timeout=0).disconnect()
    d.open("http://127.0.0.1:8000/")

    def titled():
        for w in windows(d, "firefox"):
            if "vmon desktop page" in d.get_window_title(w):
                return w
        return None

    return wait_for(titled, timeout=300, interval=2, what="Firefox's window titled by the page")


# ---- the stream in a real browser ------------------------------------------------------------


@pytest.fixture
def browser(vmon):
    """Headless Chromium (selenium) trusting vmon's local CA through an NSS database of its own."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: run scripts/install-test-deps.sh (apt-get install {pkg})")
    if shutil.which("certutil") is None:
        pytest.fail("certutil is missing: run scripts/install-test-deps.sh (apt-get install libnss3-tools)")
    home = Path(tempfile.mkdtemp(prefix="vmon-desktop-chromium-"))
    ca = _proxy_ca(vmon)
    nss = home / ".pki" / "nssdb"
    nss.mkdir(parents=True)
    subprocess.run(["certutil", "-d", f"sql:{nss}", "-N", "--empty-password"], check=True)
    subprocess.run(["certutil", "-d", f"sql:{nss}", "-A", "-t", "C,,", "-n", "vmon local CA", "-i", str(ca)], check=True)
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={home / 'profile'}",
        "--window-size=1400,1000",
    ):
        opts.add_argument(flag)
    env = dict(os.environ, HOME=str(home))
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER, env=env), options=opts)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(home, ignore_errors=True)


def _proxy_ca(vmon) -> Path:
    """The local CA `vmon up` serves the proxy's https with (the file it exports for Node)."""
    out = vmon.vmon("up", "--print-env", "--wait-secs", "60")
    for line in out.splitlines():
        if line.startswith("export NODE_EXTRA_CA_CERTS="):
            return Path(line.split("=", 1)[1])
    pytest.fail(f"vmon up --print-env names no local CA: {out}")


CANVAS = """
const c = document.querySelector('#noVNC_container canvas') || document.querySelector('canvas');
if (!c || !c.width) return null;
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
const seen = new Set();
for (let i = 0; i < d.length; i += 4 * 97) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
return [c.width, c.height, seen.size,
        document.documentElement.classList.contains('noVNC_connected')];
"""


def view(driver, url: str, name: str, size=(W, H)) -> None:
    """Opens the stream's URL and waits until noVNC is connected and its canvas shows the
    desktop (the remote size, many colours); saves a screenshot of the page."""
    assert url.startswith("https://"), url
    driver.get(url)

    def shown():
        r = driver.execute_script(CANVAS)
        return r if r and r[3] and r[0] == size[0] and r[1] == size[1] and r[2] > 20 else None

    wait_for(shown, timeout=120, interval=1, what=f"noVNC connected with a drawn canvas at {url}")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"desktop-{name}.png"
    assert driver.save_screenshot(str(path))
    page = Image.open(path).convert("RGB")
    assert colors(page) > 20, f"the page's screenshot {path} is blank"


def test_stream_in_a_browser(desktop, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    stop_xev(desktop)
    desktop.stream.start()
    with pytest.raises(RuntimeError):
        desktop.stream.start()
    url = desktop.stream.get_url()
    assert url == f"https://{desktop.get_host(6080)}/vnc.html?autoconnect=true&resize=scale"
    view(browser, url, "stream")
    # Input through the viewer reaches the desktop (over the proxy's WebSocket).
    desktop.move_mouse(5, 5)
    canvas = browser.find_element(By.CSS_SELECTOR, "#noVNC_container canvas")
    ActionChains(browser).move_to_element_with_offset(canvas, 40, 30).perform()
    wait_for(lambda: desktop.get_cursor_position() != (5, 5) or None, timeout=30, what="the viewer's pointer in the guest")

    # view_only: the same picture; the viewer's pointer stays out of the desktop.
    ro = desktop.stream.get_url(view_only=True)
    assert "view_only=true" in ro
    view(browser, ro, "view-only")
    desktop.move_mouse(5, 5)
    canvas = browser.find_element(By.CSS_SELECTOR, "#noVNC_container canvas")
    ActionChains(browser).move_to_element_with_offset(canvas, -40, -30).click().perform()
    time.sleep(3)
    assert desktop.get_cursor_position() == (5, 5)

    desktop.stream.stop()
    # x11vnc takes a second or two to exit after the SDK's `pkill x11vnc`; until then the SDK's
    # `start` says "Stream is already running" (as anywhere x11vnc runs).
    wait_for(
        lambda: desktop.commands.run("pgrep -x x11vnc || true").stdout.strip() == "" or None,
        timeout=30,
        what="x11vnc to exit",
    )

    # With a password: the URL with the key connects, the one without asks for it.
    desktop.stream.start(require_auth=True)
    key = desktop.stream.get_auth_key()
    assert len(key) == 16
    view(browser, desktop.stream.get_url(auth_key=key), "auth")
    browser.get(desktop.stream.get_url())
    time.sleep(5)
    r = browser.execute_script(CANVAS)
    assert not (r and r[3]), "connected without the key"
    asked = browser.execute_script(
        "return document.getElementById('noVNC_credentials_dlg').classList.contains('noVNC_open')"
    )
    assert asked, "noVNC does not ask for the password"
    desktop.stream.stop()


def test_pause_resume_and_fork_keep_the_browser_and_the_stream(desktop, browser):
    page = open_page(desktop)
    if not desktop.commands.run("pgrep -x x11vnc || true").stdout.strip():
        desktop.stream.start()
    url = desktop.stream.get_url()
    view(browser, url, "before-pause")

    desktop.pause()
    desktop.connect(timeout=1800)
    assert "vmon desktop page" in desktop.get_window_title(page)
    assert png(desktop.screenshot()).size == (W, H)
    view(browser, url, "after-resume")

    (child,) = desktop.fork(count=1, timeout=600)
    try:
        title = child.commands.run(f"DISPLAY=:0 xdotool getwindowname {page}").stdout.strip()
        assert "vmon desktop page" in title
        view(browser, f"https://{child.get_host(6080)}/vnc.html?autoconnect=true&resize=scale", "fork")
    finally:
        child.kill()
    assert "vmon desktop page" in desktop.get_window_title(page), "the parent after the fork"


def test_js_sdk_desktop(vmon):
    """@e2b/desktop (tests/e2e/js/desktop.mjs): every method of its Sandbox and stream, checked in
    the guest, run with node as test_js.py runs the JS SDK."""
    from test_js import JS, _node_env

    env = _node_env(vmon)
    # The stream's URL is fetched over https: Node trusts vmon's local CA through this.
    env["NODE_EXTRA_CA_CERTS"] = str(_proxy_ca(vmon))
    r = subprocess.run(["node", "desktop.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: kill" in r.stdout

"""The web dashboard in a real browser: Debian's headless Chromium driven by selenium, against
`vmon up` with real sandboxes. Sign in with the team key, see a sandbox made by the SDK appear
with its sparklines, open it, watch its CPU chart draw points and its console log follow, pause,
resume and kill it from the page and check each through the SDK; webhooks and error messages.

Screenshots go to VMON_SCREENSHOT_DIR (default /var/tmp/vmon-e2e/screenshots); the README's
`docs/dashboard.png` is one of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxState
from e2b.exceptions import SandboxNotFoundException
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import wait_for

CHROMIUM = os.environ.get("VMON_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("VMON_CHROMEDRIVER", "/usr/bin/chromedriver")
SCREENSHOTS = Path(os.environ.get("VMON_SCREENSHOT_DIR", "/var/tmp/vmon-e2e/screenshots"))
# Under TCG the guest is slow and the node samples metrics every 5 s.
SLOW = 180


@pytest.fixture
def browser():
    for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: run scripts/install-test-deps.sh (apt-get install {pkg})")
    profile = tempfile.mkdtemp(prefix="vmon-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,1000",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def shot(driver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"screenshot {path} failed"
    return path


def until(driver, predicate, timeout: float = 30, what: str = "condition"):
    """Waits for `predicate(driver)` to be truthy; the message names what never happened."""
    # Pages re-render rows as data changes: an element replaced mid-check is checked again.
    wait = WebDriverWait(driver, timeout, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(predicate, message=f"timed out waiting for {what}")


def visible(driver, element_id: str) -> bool:
    return driver.find_element(By.ID, element_id).is_displayed()


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def sign_in(driver, vmon, key: str | None = None) -> None:
    driver.get(f"{vmon.api_url}/dashboard/")
    until(driver, lambda d: visible(d, "view-signin"), what="the sign-in form")
    field = driver.find_element(By.ID, "signin-key")
    field.clear()
    field.send_keys(key or vmon.api_key)
    driver.find_element(By.ID, "signin-submit").click()


def accept_confirm(driver) -> None:
    def alert(d):
        try:
            return d.switch_to.alert
        except NoAlertPresentException:
            return False

    until(driver, alert, 10, "the confirm dialog").accept()


def test_pages_are_served_with_a_strict_policy(vmon):
    with httpx.Client(base_url=vmon.api_url, timeout=30) as c:
        page = c.get("/dashboard/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["x-frame-options"] == "DENY"
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp
        assert c.get("/dashboard").status_code == 308
        assert c.get("/dashboard/nothing.js").json()["code"] == 404


def test_sign_in_keeps_the_key_out_of_urls(browser, vmon):
    sign_in(browser, vmon, "e2b_not_a_key")
    until(browser, lambda d: "401" in text(d, "signin-message"), what="the rejected key's message")
    assert "invalid API key" in text(browser, "signin-message")
    assert browser.execute_script("return sessionStorage.getItem('vmon.apiKey')") is None

    sign_in(browser, vmon)
    until(browser, lambda d: visible(d, "view-sandboxes"), what="the sandboxes page")
    assert browser.execute_script("return sessionStorage.getItem('vmon.apiKey')") == vmon.api_key
    assert browser.find_element(By.ID, "signin-key").get_attribute("value") == ""
    urls = browser.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]"
    )
    assert len(urls) > 1
    assert not [u for u in urls if vmon.api_key in u], urls

    browser.find_element(By.ID, "signout").click()
    until(browser, lambda d: visible(d, "view-signin"), what="the sign-in form after signing out")
    assert browser.execute_script("return sessionStorage.getItem('vmon.apiKey')") is None


def test_a_sandbox_from_the_sdk_on_the_page(browser, vmon, new_sandbox):
    marker = f"dash-{uuid.uuid4().hex[:10]}"
    hostile = "<img id=pwned src=x onerror=alert(1)>"
    sbx = new_sandbox(timeout=900, metadata={"dash": marker, "html": hostile})
    assert sbx.commands.run(f"echo {marker}").stdout.strip() == marker

    sign_in(browser, vmon)
    until(browser, lambda d: visible(d, "view-sandboxes"), what="the sandboxes page")

    # A filter nothing matches hides it; its own metadata finds it.
    meta = browser.find_element(By.ID, "filter-metadata")
    meta.send_keys("dash=no-such-value")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    until(browser, lambda d: visible(d, "sandboxes-empty"), what="an empty filtered list")
    assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-sandbox-id="{sbx.sandbox_id}"]')
    meta.clear()
    meta.send_keys(f"dash={marker}")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    row_css = f'tr[data-sandbox-id="{sbx.sandbox_id}"]'
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row_css), SLOW, "the SDK's sandbox in the list")[0]
    assert row.get_attribute("data-state") == "running"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#sandboxes-body tr")) == 1
    # Metadata is text, never markup.
    assert hostile in row.text
    assert not browser.find_elements(By.ID, "pwned")

    spark = f"{row_css} canvas.spark.cpu"
    until(
        browser,
        lambda d: int(d.find_element(By.CSS_SELECTOR, spark).get_attribute("data-points")) >= 1,
        SLOW,
        "the CPU sparkline's first point",
    )
    shot(browser, "sandboxes")

    # Phone width: nothing wider than the screen.
    browser.set_window_size(390, 844)
    time.sleep(1)
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the list is {overflow}px wider than a phone"
    shot(browser, "sandboxes-phone")
    browser.set_window_size(1280, 1000)

    row.find_element(By.CSS_SELECTOR, "a").click()
    until(browser, lambda d: visible(d, "view-sandbox"), what="the sandbox page")
    assert text(browser, "sbx-id") == sbx.sandbox_id
    until(browser, lambda d: text(d, "sbx-state") == "running", 30, "the running badge")

    cpu = browser.find_element(By.ID, "chart-cpu")
    until(browser, lambda d: int(cpu.get_attribute("data-points")) >= 2, SLOW, "two CPU points")
    assert 0 <= float(cpu.get_attribute("data-last")) <= 100
    assert int(browser.find_element(By.ID, "chart-mem").get_attribute("data-points")) >= 2
    # The canvas really has ink on it, not only the attribute.
    inked = browser.execute_script(
        "const c = arguments[0]; const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < px.length; i += 4) if (px[i]) n++; return n;",
        cpu,
    )
    assert inked > 100

    until(browser, lambda d: marker in text(d, "log"), SLOW, "the command's console line")
    lines = int(browser.find_element(By.ID, "log").get_attribute("data-lines"))
    assert lines > 1
    until(browser, lambda d: "created" in text(d, "events"), 30, "the created event")

    # New console lines are followed, once each.
    later = f"{marker}-later"
    sbx.commands.run(f"echo {later}")
    until(browser, lambda d: later in text(d, "log"), SLOW, "a later console line")
    seen = [
        line
        for line in browser.execute_script(
            "return [...document.querySelectorAll('#log .line .text')].map(e => e.textContent)"
        )
        if later in line
    ]
    assert len(seen) == len(set(seen)), f"duplicated console lines: {seen}"
    shot(browser, "sandbox")
    # The README's picture: the whole page at a laptop's width.
    browser.set_window_size(1200, 1480)
    time.sleep(1.5)
    shot(browser, "dashboard")
    browser.set_window_size(1280, 1000)

    # Pause from the page; the SDK sees it.
    browser.find_element(By.ID, "act-pause").click()
    until(browser, lambda d: text(d, "action-status") == "Paused.", SLOW, "the pause to finish")
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    until(browser, lambda d: text(d, "sbx-state") == "paused", 30, "the paused badge")
    assert browser.find_element(By.ID, "act-resume").is_enabled()
    assert not browser.find_element(By.ID, "act-pause").is_enabled()
    until(browser, lambda d: "paused" in text(d, "events"), 30, "the paused event")

    # Resume, then kill (after the confirm dialog).
    browser.find_element(By.ID, "act-resume").click()
    until(browser, lambda d: text(d, "action-status").startswith("Resumed"), SLOW, "the resume to finish")
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    browser.find_element(By.ID, "act-kill").click()
    accept_confirm(browser)
    until(browser, lambda d: text(d, "action-status") == "Killed.", SLOW, "the kill to finish")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    until(browser, lambda d: text(d, "sbx-state") == "killed", 30, "the killed badge")
    until(browser, lambda d: "killed" in text(d, "events"), 30, "the killed event")
    # The console log stays readable after the kill.
    assert marker in text(browser, "log")


def test_webhooks_and_api_errors(browser, vmon):
    sign_in(browser, vmon)
    until(browser, lambda d: visible(d, "view-sandboxes"), what="the sandboxes page")
    browser.get(f"{vmon.api_url}/dashboard/#/webhooks")
    until(browser, lambda d: visible(d, "view-webhooks"), what="the webhooks page")

    name = f"<i id=pwned>hook-{uuid.uuid4().hex[:8]}</i>"
    browser.find_element(By.ID, "wh-name").send_keys(name)
    browser.find_element(By.ID, "wh-url").send_keys("ftp://127.0.0.1/hook")
    browser.find_element(By.ID, "wh-secret").send_keys("s3cret-for-tests")
    browser.find_element(By.CSS_SELECTOR, "#webhook-form button[type=submit]").click()
    # The api's {code, message} shows as it was sent.
    until(browser, lambda d: "failed: 400:" in text(d, "webhook-status"), 30, "the 400 message")
    assert "http:// or https://" in text(browser, "webhook-status")

    url = browser.find_element(By.ID, "wh-url")
    url.clear()
    url.send_keys("http://127.0.0.1:9/hook")
    browser.find_element(By.ID, "wh-secret").send_keys("s3cret-for-tests")
    browser.find_element(By.CSS_SELECTOR, "#webhook-form button[type=submit]").click()
    until(browser, lambda d: text(d, "webhook-status").startswith("Created"), 30, "the created webhook")

    with httpx.Client(base_url=vmon.api_url, timeout=30) as c:
        hooks = c.get("/events/webhooks", headers={"X-API-Key": vmon.api_key}).json()
    hook = next(h for h in hooks if h["name"] == name)
    row_css = f'tr[data-webhook-id="{hook["id"]}"]'
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row_css), 30, "the webhook's row")[0]
    assert name in row.text
    assert not browser.find_elements(By.ID, "pwned")

    def button(label: str):
        return browser.find_element(By.CSS_SELECTOR, row_css).find_element(By.XPATH, f".//button[text()='{label}']")

    button("Deliveries").click()
    until(browser, lambda d: visible(d, "deliveries"), 30, "the deliveries panel")
    until(browser, lambda d: "Attempts" in text(d, "deliveries-stats"), 30, "the webhook's stats")
    assert name in text(browser, "deliveries-name")

    button("Disable").click()
    until(
        browser,
        lambda d: "disabled" in d.find_element(By.CSS_SELECTOR, row_css).text,
        30,
        "the disabled badge",
    )
    with httpx.Client(base_url=vmon.api_url, timeout=30) as c:
        got = c.get(f"/events/webhooks/{hook['id']}", headers={"X-API-Key": vmon.api_key}).json()
    assert got["enabled"] is False
    shot(browser, "webhooks")

    button("Delete").click()
    accept_confirm(browser)
    until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, row_css), 30, "the webhook's row to go")
    with httpx.Client(base_url=vmon.api_url, timeout=30) as c:
        r = c.get(f"/events/webhooks/{hook['id']}", headers={"X-API-Key": vmon.api_key})
    assert r.status_code == 404

    # A key revoked mid-session sends the page back to sign-in with the api's message.
    browser.execute_script("sessionStorage.setItem('vmon.apiKey', 'e2b_revoked')")
    browser.get(f"{vmon.api_url}/dashboard/#/sandboxes")
    until(browser, lambda d: visible(d, "view-signin"), 30, "the sign-in form")
    assert "invalid API key" in text(browser, "signin-message")

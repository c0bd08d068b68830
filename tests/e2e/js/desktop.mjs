// JS desktop test (@e2b/desktop, pinned in package.json), run by ../test_desktop.py: every method
// of the SDK's Sandbox and stream in one desktop, each checked by what it did in the guest (the
// events an X client, `xev`, saw; the screen's size; the page the stream serves through vmon's
// proxy). Configured only by E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL (and
// NODE_EXTRA_CA_CERTS for the proxy's https). Exits non-zero on the first failed check.
import { Sandbox } from '@e2b/desktop'

function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function waitFor(what, f, timeoutMs = 60_000, intervalMs = 500) {
  const end = Date.now() + timeoutMs
  let last
  while (Date.now() < end) {
    last = await f()
    if (last) return last
    await sleep(intervalMs)
  }
  check(false, `${what} (last: ${JSON.stringify(last)})`)
}

// The PNG's size from its IHDR chunk.
function pngSize(bytes) {
  const b = Buffer.from(bytes)
  if (b.subarray(0, 8).toString('hex') !== '89504e470d0a1a0a') return null
  return [b.readUInt32BE(16), b.readUInt32BE(20)]
}

// xdotool's search exits 1 when nothing matches, which the SDK throws (as on E2B).
async function windows(d, app) {
  try {
    return (await d.getApplicationWindows(app)).filter((w) => w)
  } catch (e) {
    return []
  }
}

const run = async (d, cmd) => (await d.commands.run(cmd)).stdout

// xev's window, its events in /tmp/xev.log (stdbuf: written as they come).
async function startXev(d) {
  await run(d, 'pkill -x xev; rm -f /tmp/xev.log; true')
  const h = await d.commands.run(
    'stdbuf -oL xev -geometry 500x400+100+100 -event mouse -event keyboard -event button >/tmp/xev.log 2>&1',
    { background: true, timeoutMs: 0 },
  )
  await h.disconnect()
  const ids = await waitFor("xev's window", async () =>
    (await run(d, "xdotool search --onlyvisible --name '^Event Tester$' || true")).split(/\s+/).filter((w) => w),
  )
  return ids[0]
}

async function events(d, kind) {
  return (await run(d, 'cat /tmp/xev.log')).split('\n\n').filter((b) => b.startsWith(kind))
}

// The first create may wait for the template's build.
const desktop = await Sandbox.create({ resolution: [800, 600], dpi: 96, timeoutMs: 600_000, requestTimeoutMs: 1_800_000 })
try {
  const size = await desktop.getScreenSize()
  check(size.width === 800 && size.height === 600, `create({resolution}) and getScreenSize ${JSON.stringify(size)}`)
  check((await run(desktop, 'xdpyinfo | grep resolution')).includes('96x96 dots per inch'), 'create({dpi})')
  const dims = pngSize(await desktop.screenshot())
  check(dims !== null && dims[0] === 800 && dims[1] === 600, `screenshot is an 800x600 PNG (${dims})`)

  const win = await startXev(desktop)
  await desktop.moveMouse(123, 234)
  const pos = await desktop.getCursorPosition()
  check(pos.x === 123 && pos.y === 234, `moveMouse/getCursorPosition ${JSON.stringify(pos)}`)
  await desktop.leftClick(200, 200)
  await desktop.rightClick(210, 200)
  await desktop.middleClick(220, 200)
  await desktop.doubleClick(230, 200)
  await desktop.scroll('up', 2)
  await desktop.scroll('down', 1)
  await desktop.drag([150, 150], [350, 300])
  await desktop.mousePress('right')
  await desktop.mouseRelease('right')
  const want = [1, 3, 2, 1, 1, 4, 4, 5, 1, 3].join(',')
  const buttons = async () =>
    (await events(desktop, 'ButtonPress')).map((b) => (b.match(/button (\d+)/) || [])[1]).filter((x) => x).join(',')
  await waitFor(`button presses ${want}`, async () => (await buttons()) === want || (await buttons()), 30_000)
  check((await buttons()) === want, 'leftClick, rightClick, middleClick, doubleClick, scroll, drag, mousePress/mouseRelease')
  const releases = await events(desktop, 'ButtonRelease')
  check(releases.length >= 2 && releases[releases.length - 2].includes('root:(350,300)'), 'drag ends where asked')

  await desktop.leftClick(300, 300)
  await desktop.write('Hi 2u!')
  await desktop.press('enter')
  await desktop.press(['ctrl', 'a'])
  const keys = async () =>
    (await events(desktop, 'KeyPress'))
      .map((b) => (b.match(/keysym 0x[0-9a-f]+, (\w+)\)/) || [])[1])
      .filter((k) => k && k !== 'Shift_L' && k !== 'Shift_R')
      .join(',')
  const wantKeys = 'H,i,space,2,u,exclam,Return,Control_L,a'
  await waitFor(`keys ${wantKeys}`, async () => (await keys()) === wantKeys, 30_000)
  check(true, 'write, press, press([hotkey])')
  check((await desktop.getCurrentWindowId()) === win, 'getCurrentWindowId is the focused window')
  check((await desktop.getWindowTitle(win)) === 'Event Tester', 'getWindowTitle')
  await run(desktop, 'pkill -x xev || true')

  const t0 = Date.now()
  await desktop.wait(500)
  check(Date.now() - t0 >= 500, 'wait(500)')

  await desktop.launch('xfce4-terminal')
  const term = await waitFor('the terminal launched', () => windows(desktop, 'xfce4-terminal'), 120_000)
  check(term.length > 0, `launch and getApplicationWindows (${term})`)
  await run(desktop, 'pkill -f xfce4-terminal || true')
  await desktop.open('/usr/share/doc/xdg-utils/README')
  // xdg-open of a file: its handler runs (mousepad is not installed: xdg-open says which it
  // tried); the check is that xdg-open ran and exited.
  await waitFor('xdg-open to run', async () => (await run(desktop, 'pgrep -f xdg-open || echo done')).includes('done'), 60_000)
  check(true, 'open')

  await desktop.stream.start({ requireAuth: true })
  const key = desktop.stream.getAuthKey()
  check(key.length > 0, 'stream.start({requireAuth}) and getAuthKey')
  const url = desktop.stream.getUrl({ authKey: key, viewOnly: true })
  check(
    url.startsWith(`https://${desktop.getHost(6080)}/vnc.html?`) && url.includes('view_only=true') && url.includes(`password=${key}`),
    `stream.getUrl ${url}`,
  )
  // The page through the proxy, over https with vmon's local CA (NODE_EXTRA_CA_CERTS).
  const page = await waitFor('noVNC page through the proxy', async () => {
    try {
      const res = await fetch(url)
      return res.status === 200 ? await res.text() : null
    } catch (e) {
      return null
    }
  })
  check(page.includes('noVNC'), 'the stream URL serves noVNC over https')
  await desktop.stream.stop()
  // x11vnc exits a second or two after the SDK's `pkill x11vnc`.
  await waitFor('x11vnc to exit', async () => (await run(desktop, 'pgrep -x x11vnc || true')).trim() === '')
  check(true, 'stream.stop')

  check((await desktop.kill()) === true, 'kill')
} catch (e) {
  console.error(e)
  await Sandbox.kill(desktop.sandboxId).catch(() => {})
  process.exit(1)
}

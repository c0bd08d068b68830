// JS desktop smoke test (@e2b/desktop, pinned in package.json): a desktop at a chosen size, a
// screenshot of that size, the mouse and the keyboard, the stream's URL served through vmon's
// proxy. Configured only by E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL. Exits non-zero on the
// first failed check.
import { Sandbox } from '@e2b/desktop'

function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

// The PNG's size from its IHDR chunk.
function pngSize(bytes) {
  const b = Buffer.from(bytes)
  const sig = b.subarray(0, 8).toString('hex')
  if (sig !== '89504e470d0a1a0a') return null
  return [b.readUInt32BE(16), b.readUInt32BE(20)]
}

// The first create may wait for the template's build.
const desktop = await Sandbox.create({ resolution: [800, 600], dpi: 96, timeoutMs: 600_000, requestTimeoutMs: 1_800_000 })
try {
  const size = await desktop.getScreenSize()
  check(size.width === 800 && size.height === 600, `getScreenSize ${JSON.stringify(size)}`)
  const shot = await desktop.screenshot()
  const dims = pngSize(shot)
  check(dims !== null && dims[0] === 800 && dims[1] === 600, `screenshot is an 800x600 PNG (${dims})`)

  await desktop.moveMouse(123, 234)
  const pos = await desktop.getCursorPosition()
  check(pos.x === 123 && pos.y === 234, `moveMouse/getCursorPosition ${JSON.stringify(pos)}`)
  await desktop.leftClick(300, 300)
  await desktop.press('escape')

  await desktop.stream.start()
  const url = desktop.stream.getUrl()
  check(url.startsWith(`https://${desktop.getHost(6080)}/vnc.html?`), `stream url ${url}`)
  // The page through the proxy (the CA of vmon up is in NODE_EXTRA_CA_CERTS when it serves TLS;
  // plain http reaches the same route).
  let page = null
  for (let i = 0; i < 60 && page === null; i++) {
    try {
      const res = await fetch(`http://${desktop.getHost(6080)}/vnc.html`)
      if (res.status === 200) page = await res.text()
    } catch (e) {}
    if (page === null) await new Promise((r) => setTimeout(r, 500))
  }
  check(page !== null && page.includes('noVNC'), 'noVNC page through the proxy')
  await desktop.stream.stop()
  // x11vnc exits a second or two after the SDK's `pkill x11vnc`.
  let running = true
  for (let i = 0; i < 60 && running; i++) {
    running = (await desktop.commands.run('pgrep -x x11vnc || true')).stdout.trim() !== ''
    if (running) await new Promise((r) => setTimeout(r, 500))
  }
  check(!running, 'stream.stop')

  check((await desktop.kill()) === true, 'kill')
} catch (e) {
  console.error(e)
  await Sandbox.kill(desktop.sandboxId).catch(() => {})
  process.exit(1)
}

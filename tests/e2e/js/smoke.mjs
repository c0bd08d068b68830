// JS SDK smoke test: create, run, pause, connect, getHost, kill. Configured only by E2B_API_URL,
// E2B_API_KEY and E2B_SANDBOX_URL. Exits non-zero on the first failed check.
import { Sandbox } from 'e2b'

function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const sbx = await Sandbox.create('base', { timeoutMs: 300_000, metadata: { from: 'js' } })
try {
  const r = await sbx.commands.run('echo hello-from-js')
  check(r.exitCode === 0 && r.stdout === 'hello-from-js\n', 'commands.run')
  await sbx.files.write('/home/user/js.txt', 'js state')
  await sbx.commands.run('sync')

  check((await sbx.pause()) === true, 'pause')
  const info = await Sandbox.getInfo(sbx.sandboxId)
  check(info.state === 'paused', 'paused state')

  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
  check(again.sandboxId === sbx.sandboxId, 'connect keeps the id')
  check((await again.files.read('/home/user/js.txt')) === 'js state', 'state after resume')
  const r2 = await again.commands.run('echo still-here')
  check(r2.stdout === 'still-here\n', 'commands after resume')

  // A server in the sandbox, reached through getHost over plain HTTP.
  await again.commands.run('cd /home/user && python3 -m http.server 8000', { background: true })
  const host = again.getHost(8000)
  let body = null
  for (let i = 0; i < 60 && body === null; i++) {
    try {
      const res = await fetch(`http://${host}/js.txt`)
      if (res.status === 200) body = await res.text()
    } catch (e) {}
    if (body === null) await new Promise((r) => setTimeout(r, 500))
  }
  check(body === 'js state', `getHost ${host}`)

  check((await again.kill()) === true, 'kill')
  check((await Sandbox.kill(sbx.sandboxId)) === false, 'second kill is false')
} catch (e) {
  console.error(e)
  await Sandbox.kill(sbx.sandboxId).catch(() => {})
  process.exit(1)
}

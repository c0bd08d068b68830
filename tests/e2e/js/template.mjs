// The JS SDK's Template.build (chunked JSON bodies, uploads in parallel) against vmon, then a
// sandbox from the template. Configured only by E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL.
// Exits non-zero on the first failed check.
import { mkdtempSync, mkdirSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Sandbox, Template, waitForPort } from 'e2b'

function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const ctx = mkdtempSync(join(tmpdir(), 'vmon-js-tpl-'))
writeFileSync(join(ctx, 'one.txt'), 'one from js\n')
mkdirSync(join(ctx, 'two'))
writeFileSync(join(ctx, 'two', 'inner.txt'), 'two from js\n')

const name = `js-tpl-${Math.random().toString(16).slice(2, 10)}`
const template = Template({ fileContextPath: ctx })
  .fromBaseImage()
  .copy('one.txt', '/home/user/one.txt')
  .copy('two', '/home/user/two/')
  .runCmd('echo "$FROM_ENV" > /home/user/env.txt')
  .setEnvs({ FROM_ENV: 'set by setEnvs' })
  .runCmd('echo "$FROM_ENV" > /home/user/env2.txt')
  .setStartCmd('python3 -m http.server 8080', waitForPort(8080))

const logs = []
const info = await Template.build(template, name, { onBuildLogs: (e) => logs.push(e.message) })
check(info.templateId && info.buildId, 'Template.build returns ids')
check(logs.some((m) => m.includes('COPY one.txt')), 'build logs reach onBuildLogs')
check(await Template.exists(name), 'Template.exists')

const sbx = await Sandbox.create(name, { timeoutMs: 120_000 })
try {
  const r = await sbx.commands.run('cat /home/user/one.txt /home/user/two/inner.txt /home/user/env2.txt')
  check(r.stdout === 'one from js\ntwo from js\nset by setEnvs\n', 'files and ENV in the sandbox')
  const e = await sbx.commands.run('cat /home/user/env.txt')
  check(e.stdout === '\n', 'ENV applies only to later steps')
  const page = await sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/")
  check(page.stdout.trim() === '200', 'the start command runs in the sandbox')
} finally {
  await sbx.kill()
}
console.log(`template: ${name}`)

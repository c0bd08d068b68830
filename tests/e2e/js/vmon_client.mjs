// clients/js against vmon up (run by ../test_clients.py): idle policy on create, resume,
// health, fork of a paused sandbox, the admin verbs.
import assert from 'node:assert/strict'
import { InvalidArgumentError } from 'e2b'
import { Admin, Sandbox } from 'vmon-client'

const made = []
const ok = (what) => console.log(`ok: ${what}`)
try {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, idle: { maxIdleSeconds: 120 } })
  made.push(sbx)
  assert.ok(sbx instanceof Sandbox)
  let h = await sbx.getHealth()
  assert.deepEqual(h.idle, { maxIdleSeconds: 120, autoResume: true, suspendedDurationSeconds: 180 })
  assert.equal(h.resumeGeneration, 0)
  assert.equal(h.stateLocation, 'running')
  ok('idle on create, health')

  await assert.rejects(Sandbox.create({ timeoutMs: 300_000, idle: { maxIdleSeconds: 30 } }), InvalidArgumentError)
  ok('an invalid idle policy is refused')

  await sbx.files.write('/home/user/mark.txt', 'from the parent')
  await sbx.commands.run('sync')
  assert.equal(await sbx.pause(), true)
  const children = await sbx.fork({ timeoutMs: 300_000 })
  const child = children[0]
  assert.ok(!(child instanceof Error), String(child))
  made.push(child)
  assert.equal(await child.files.read('/home/user/mark.txt'), 'from the parent')
  assert.equal((await Sandbox.getHealth(sbx.sandboxId)).state, 'paused')
  ok('fork of a paused sandbox')

  assert.equal(await sbx.resume({ timeoutMs: 300_000 }), sbx)
  h = await Sandbox.getHealth(sbx.sandboxId)
  assert.equal(h.state, 'running')
  assert.equal(h.resumeGeneration, 1)
  assert.ok(['restore', 'parked'].includes(h.lastResume.kind), JSON.stringify(h))
  assert.equal(h.kernelStateLost, false)
  assert.equal((await sbx.commands.run('cat /home/user/mark.txt')).stdout, 'from the parent')
  ok('resume, health after it')

  const off = await Sandbox.create({ timeoutMs: 300_000, idle: null })
  made.push(off)
  assert.equal((await off.getHealth()).idle, null)
  ok('idle: null')

  const admin = new Admin()
  const team = await admin.createTeam('client-js-team')
  assert.ok(team.apiKey.startsWith('e2b_'))
  assert.ok((await admin.listTeams()).some((t) => t.id === team.team.id))
  const second = await admin.createKey(team.team.id)
  assert.ok((await admin.listKeys(team.team.id)).length >= 2)
  await admin.revokeKey(second.key.id)
  const revoked = (await admin.listKeys(team.team.id)).find((k) => k.id === second.key.id)
  assert.equal(revoked.revoked, true)
  assert.ok((await admin.listSandboxes()).some((s) => s.sandboxID === sbx.sandboxId))
  ok('admin verbs')
  ok('all')
} finally {
  for (const s of made) {
    await s.kill().catch(() => {})
  }
}

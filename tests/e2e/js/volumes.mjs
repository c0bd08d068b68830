// JS SDK volumes and secrets: Volume.create, writeFile, a mount by Volume and by name, a write
// from inside, readFile, list, destroy; Secret create/getInfo/update/list/destroy. Configured
// only by E2B_API_URL, E2B_API_KEY, E2B_SANDBOX_URL and E2B_VOLUME_API_URL.
import { Sandbox, Secret, Volume } from 'e2b'

function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`)
    process.exit(1)
  }
  console.log(`ok: ${what}`)
}

const name = `js-vol-${Date.now()}`
const vol = await Volume.create(name)
try {
  check(vol.name === name && vol.volumeId.length === 36, 'Volume.create')
  const stat = await vol.writeFile('/from-js.txt', 'written by the JS SDK')
  check(stat.size === 21 && stat.type === 'file', 'writeFile')
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000, volumeMounts: { '/mnt/js': vol } })
  try {
    const r = await sbx.commands.run('cat /mnt/js/from-js.txt && echo inside > /mnt/js/in.txt')
    check(r.stdout === 'written by the JS SDK', 'mounted by Volume, read in the guest')
  } finally {
    await sbx.kill()
  }
  check((await vol.readFile('/in.txt')) === 'inside\n', 'readFile of a guest write')
  const names = (await vol.list('/')).map((e) => e.name).sort()
  check(JSON.stringify(names) === '["from-js.txt","in.txt"]', 'list')
  const again = await Volume.connect(vol.volumeId)
  check(again.token && again.name === name, 'Volume.connect')
  check((await Volume.list()).some((v) => v.volumeId === vol.volumeId), 'Volume.list')
} finally {
  check((await Volume.destroy(vol.volumeId)) === true, 'Volume.destroy')
}
check((await Volume.destroy(vol.volumeId)) === false, 'Volume.destroy of a destroyed volume')

const secretName = `js-sec-${Date.now()}`
const s = await Secret.create(secretName, 'js-secret-value', { metadata: { lang: 'js' } })
check(s.secretId.startsWith('sec_') && s.version === 1, 'Secret.create')
check((await Secret.getInfo(secretName)).secretId === s.secretId, 'Secret.getInfo by name')
check((await Secret.update(s.secretId, 'v2')).version === 2, 'Secret.update')
const page = Secret.list({ limit: 100 })
const listed = await page.nextItems()
check(listed.some((x) => x.secretId === s.secretId), 'Secret.list')
check(JSON.stringify(listed).indexOf('js-secret-value') < 0, 'no value in a list')
check((await Secret.destroy(secretName)) === true, 'Secret.destroy')
check((await Secret.exists(secretName)) === false, 'Secret.exists after destroy')
console.log('ok: done')

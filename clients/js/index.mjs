// vmon's features beyond E2B, on top of the official `e2b` SDK: `Sandbox` is e2b's Sandbox
// with `resume()`, `getHealth()` and an `idle` policy on `create()`; `Admin` drives the
// operator routes (teams, API keys, sandboxes). Every other call is the SDK's, unchanged.

import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import {
  AuthenticationError,
  ConnectionConfig,
  InvalidArgumentError,
  NotFoundError,
  Sandbox as E2BSandbox,
  SandboxError,
} from 'e2b'

const PREFIX = 'vmon.idle.'

/** Seed 004's IdlePolicy as `vmon.idle.*` metadata keys (what the official SDK can send). */
export function idleMetadata(idle) {
  if (idle === null) return { [PREFIX + 'max_idle_seconds']: 'off' }
  const out = {
    [PREFIX + 'max_idle_seconds']: String(idle.maxIdleSeconds ?? 300),
    [PREFIX + 'auto_resume']: idle.autoResume === false ? 'false' : 'true',
  }
  if (idle.suspendedDurationSeconds !== undefined && idle.suspendedDurationSeconds !== null) {
    out[PREFIX + 'suspended_duration_seconds'] = String(idle.suspendedDurationSeconds)
  }
  return out
}

async function errorOf(res) {
  let message = await res.text()
  try {
    message = JSON.parse(message).message ?? message
  } catch {}
  if (res.status === 400) return new InvalidArgumentError(message)
  if (res.status === 401 || res.status === 403) return new AuthenticationError(message)
  if (res.status === 404) return new NotFoundError(message)
  return new SandboxError(`${res.status}: ${message}`)
}

async function apiCall(config, method, path, { body, headers } = {}) {
  const h = { ...(config.headers ?? {}), ...(headers ?? {}) }
  if (config.apiKey && !h['X-Admin-Token']) h['X-API-Key'] = config.apiKey
  if (body !== undefined) h['Content-Type'] = 'application/json'
  const res = await fetch(`${config.apiUrl.replace(/\/$/, '')}${path}`, {
    method,
    headers: h,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(config.requestTimeoutMs || 60_000),
  })
  if (!res.ok) throw await errorOf(res)
  return res
}

function healthOf(d) {
  return {
    sandboxId: d.sandboxID,
    state: d.state,
    resumeGeneration: d.resumeGeneration,
    kernelStateLost: d.kernelStateLost,
    lastResume: d.lastResume ?? null,
    stateLocation: d.stateLocation,
    inObjectStore: d.inObjectStore ?? false,
    idle: d.vmonIdle ?? null,
    idleSuspended: d.idleSuspended ?? false,
    suspendedUntil: d.suspendedUntil ?? null,
    idleSeconds: d.idleSeconds ?? null,
  }
}

export class Sandbox extends E2BSandbox {
  /**
   * e2b's `Sandbox.create`, plus `idle`: `{ maxIdleSeconds, autoResume, suspendedDurationSeconds }`,
   * `null` for no auto-suspend (even when the team has a default), or absent for the team's
   * default. It travels as `vmon.idle.*` metadata, which the server checks (400,
   * `InvalidArgumentError`).
   */
  static async create(templateOrOpts, opts) {
    const named = typeof templateOrOpts === 'string'
    const o = { ...((named ? opts : templateOrOpts) ?? {}) }
    if ('idle' in o) {
      const metadata = Object.fromEntries(
        Object.entries(o.metadata ?? {}).filter(([k]) => !k.startsWith(PREFIX)),
      )
      o.metadata = { ...metadata, ...idleMetadata(o.idle) }
      delete o.idle
    }
    try {
      return await (named ? super.create(templateOrOpts, o) : super.create(o))
    } catch (e) {
      // The SDK reports a create's 400 as a plain SandboxError; an invalid request is this.
      if (e instanceof SandboxError && e.statusCode === 400) {
        throw new InvalidArgumentError(e.message)
      }
      throw e
    }
  }

  /** Resumes a paused sandbox (memory restored); a running one keeps running. */
  static async resume(sandboxId, opts) {
    return this.connect(sandboxId, opts)
  }

  async resume(opts) {
    await this.connect(opts)
    return this
  }

  /** `GET /sandboxes/{id}/health`: resumes, where the state is, the idle policy. */
  static async getHealth(sandboxId, opts) {
    const res = await apiCall(new ConnectionConfig(opts), 'GET', `/sandboxes/${sandboxId}/health`)
    return healthOf(await res.json())
  }

  async getHealth(opts) {
    const config = opts ? new ConnectionConfig(opts) : this.connectionConfig
    const res = await apiCall(config, 'GET', `/sandboxes/${this.sandboxId}/health`)
    return healthOf(await res.json())
  }
}

/** vmon's operator routes (`/admin`, `X-Admin-Token`). */
export class Admin {
  constructor({ apiUrl, adminToken, dataDir, requestTimeoutMs } = {}) {
    this.apiUrl = (apiUrl ?? process.env.E2B_API_URL ?? 'http://127.0.0.1:3000').replace(/\/$/, '')
    let token = adminToken ?? process.env.VMON_ADMIN_TOKEN
    if (!token) {
      const dir = dataDir ?? process.env.VMON_DATA_DIR ?? '/var/lib/vmon'
      token = readFileSync(join(dir, 'admin-token'), 'utf8').trim()
    }
    this.config = { apiUrl: this.apiUrl, headers: { 'X-Admin-Token': token }, requestTimeoutMs }
  }

  async #json(method, path, body) {
    const res = await apiCall(this.config, method, path, { body })
    return res.status === 204 ? undefined : res.json()
  }

  /** A team and its first API key (`{ team, apiKey, key }`: the key's only appearance). */
  createTeam(name, { slug, limits } = {}) {
    return this.#json('POST', '/admin/teams', { name, slug, limits })
  }
  listTeams() {
    return this.#json('GET', '/admin/teams')
  }
  createKey(teamId) {
    return this.#json('POST', `/admin/teams/${teamId}/keys`)
  }
  listKeys(teamId) {
    return this.#json('GET', `/admin/keys${teamId ? `?team=${encodeURIComponent(teamId)}` : ''}`)
  }
  revokeKey(keyId) {
    return this.#json('DELETE', `/admin/keys/${keyId}`)
  }
  listSandboxes() {
    return this.#json('GET', '/admin/sandboxes')
  }
  killSandbox(sandboxId) {
    return this.#json('DELETE', `/admin/sandboxes/${sandboxId}`)
  }
}

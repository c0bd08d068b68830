import { Sandbox as E2BSandbox, SandboxOpts, ConnectionOpts } from 'e2b'

export interface IdlePolicy {
  /** Seconds without traffic through vmon's proxy before the suspend (at least 60; default 300). */
  maxIdleSeconds?: number
  /** Whether the next request resumes it (default true). */
  autoResume?: boolean
  /** How long it stays suspended before it ends; 0 ends it instead (default: timeout − maxIdleSeconds). */
  suspendedDurationSeconds?: number
}

export interface LastResume {
  kind: 'restore' | 'parked' | 'cold_boot'
  durationMs: number
  at: string
  trigger: 'connect' | 'traffic'
}

export interface Health {
  sandboxId: string
  state: 'running' | 'paused'
  resumeGeneration: number
  kernelStateLost: boolean
  lastResume: LastResume | null
  stateLocation: 'running' | 'parked' | 'disk' | 'object_store' | 'unknown'
  inObjectStore: boolean
  idle: Required<IdlePolicy> | null
  idleSuspended: boolean
  suspendedUntil: string | null
  idleSeconds: number | null
}

export type VmonSandboxOpts = SandboxOpts & { idle?: IdlePolicy | null }

export declare function idleMetadata(idle: IdlePolicy | null): Record<string, string>

export declare class Sandbox extends E2BSandbox {
  static create<S extends typeof Sandbox>(this: S, opts?: VmonSandboxOpts): Promise<InstanceType<S>>
  static create<S extends typeof Sandbox>(this: S, template: string, opts?: VmonSandboxOpts): Promise<InstanceType<S>>
  static resume<S extends typeof Sandbox>(this: S, sandboxId: string, opts?: SandboxOpts): Promise<InstanceType<S>>
  resume(opts?: SandboxOpts): Promise<this>
  static getHealth(sandboxId: string, opts?: ConnectionOpts): Promise<Health>
  getHealth(opts?: ConnectionOpts): Promise<Health>
}

export declare class Admin {
  constructor(opts?: { apiUrl?: string; adminToken?: string; dataDir?: string; requestTimeoutMs?: number })
  createTeam(name: string, opts?: { slug?: string; limits?: Record<string, number> }): Promise<{ team: any; apiKey: string; key: any }>
  listTeams(): Promise<any[]>
  createKey(teamId: string): Promise<{ team: any; apiKey: string; key: any }>
  listKeys(teamId?: string): Promise<any[]>
  revokeKey(keyId: string): Promise<void>
  listSandboxes(): Promise<any[]>
  killSandbox(sandboxId: string): Promise<void>
}

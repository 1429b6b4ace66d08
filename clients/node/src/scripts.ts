/**
 * The Lua scripts the client calls, the very files of coalescer/store/lua/ (copied into
 * dist/lua/ by the build, or read from `$COALESCER_LUA_DIR`), each sent as the Python
 * writer sends it (store/script_calls.py): `_lib.lua` first, then the script, a
 * `#!lua flags=...` line kept first. ioredis runs them by SHA (EVALSHA, EVAL after a
 * NOSCRIPT) and pipelines the calls made in one tick.
 */
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { join } from "node:path";
import type { Cluster, Redis } from "ioredis";
import { ScriptError } from "./errors.js";
import { KeySpace, ShardKeys, drainedKey, layoutKey } from "./keys.js";

export type Client = Redis | Cluster;
export const KEY_SEPARATOR = "\0";
const NAMES = ["upsert", "cancel", "limits", "pending_bytes", "layout", "reshard_put"] as const;
/** rules in one upsert or cancel call at most (a call with keys of more is split) */
export const MAX_GROUPS = 16;
type Name = (typeof NAMES)[number];

/** The folder the scripts are read from. */
export function luaDir(): string {
  return process.env.COALESCER_LUA_DIR ?? fileURLToPath(new URL("./lua/", import.meta.url));
}

/** The text sent to Redis for script `name`. */
export function scriptSource(name: string, dir = luaDir()): string {
  const lib = readFileSync(join(dir, "_lib.lua"), "utf8");
  const text = readFileSync(join(dir, `${name}.lua`), "utf8");
  if (text.startsWith("#!")) {
    const cut = text.indexOf("\n");
    return `${text.slice(0, cut)}\n${lib}\n${text.slice(cut + 1)}`;
  }
  return `${lib}\n${text}`;
}

/** A group of one upsert call: keys of one rule (one shard). */
export interface UpsertGroup {
  rule: string;
  windowMs: number;
  maxWaitMs: number;
  keys: string[];
  /** written to an old shard only if it still holds them (a reshard runs) */
  held: boolean;
  /** key -> its items ("" for an overflow), for keys touched with some */
  items: Map<string, string[]> | null;
  itemsMax: number;
  /** the rule has `edge: leading` */
  leading: boolean;
  /** key -> the wire form of its time */
  schedules: Map<string, string> | null;
}

export interface UpsertResult {
  /** the layout generation the shard follows, when it is newer than the writer's */
  moved: number | null;
  scheduled: number;
  failed: Map<string, string>;
  asked: string[];
  seq: number;
  transit: string[];
}

export interface LimitsAnswer { pending: number; byAge: number; byCount: number; dead: number }

export interface Layout { gen: number; shards: number; source: number }

type Caller = (...args: (string | number)[]) => Promise<unknown>;

/** The registered scripts of one client, with typed wrappers. */
export class Scripts {
  private readonly calls = new Map<string, Caller>();

  /** `rules`: how many rules there are (the limits call names every rule's keys). */
  constructor(readonly client: Client, rules: number, dir = luaDir()) {
    const source = new Map(NAMES.map((name) => [name, scriptSource(name, dir)]));
    const groups = Math.min(MAX_GROUPS, rules);
    const counts: [Name, number][] = [["limits", 1 + 2 * rules], ["pending_bytes", 2],
      ["layout", 2], ["reshard_put", 5]];
    for (let g = 1; g <= groups; g++) counts.push(["upsert", 6 + 2 * g], ["cancel", 4 + g]);
    for (const [name, keys] of counts) this.define(name, keys, source.get(name)!);
  }

  /** One command per script and count of keys: its keys come first, so that ioredis
   * routes (and, on a Cluster, auto-pipelines) each call by its first key's slot. All
   * are defined up front: a command defined while an auto-pipeline is being filled is
   * missing from it. */
  private define(name: Name, keys: number, lua: string): void {
    const command = `coalescer_${name}_${keys}`;
    this.client.defineCommand(command, { lua, numberOfKeys: keys });
    const fn = (this.client as unknown as Record<string, Caller>)[command];
    this.calls.set(command, fn.bind(this.client));
  }

  private run(name: Name, keys: string[], args: (string | number)[]): Promise<unknown> {
    const call = this.calls.get(`coalescer_${name}_${keys.length}`);
    if (call === undefined) {
      return Promise.reject(new ScriptError(`no ${name} call with ${keys.length} keys`));
    }
    return call(...keys, ...args);
  }

  /** Schedule the groups' keys on `shard`, written with layout generation `gen`. */
  async upsert(shard: ShardKeys, groups: UpsertGroup[], gen: number, minSeq = 0): Promise<UpsertResult> {
    const keys = [shard.meta, shard.nextWake, shard.layout, shard.seq, shard.moving, shard.bytes];
    const args: (string | number)[] = [shard.wakeChannel, gen, minSeq];
    for (const g of groups) {
      keys.push(shard.due(g.rule), shard.dead(g.rule));
      args.push(g.leading ? `${g.windowMs}|${shard.quietPrefix}` : g.windowMs, g.maxWaitMs,
        g.keys.length, g.keys.join(KEY_SEPARATOR),
        g.held ? 1 : 0, timesOf(g));
    }
    const items = itemsSection(groups);
    if (items.length > 0 || groups.some((g) => g.schedules !== null)) {
      args.push(shard.itemsPrefix, ...items);
    }
    const reply = (await this.run("upsert", keys, args)) as unknown[];
    if (Number(reply[0]) === 0) {
      return { moved: Number(reply[1]), scheduled: 0, failed: new Map(), asked: [], seq: 0, transit: [] };
    }
    const failedFlat = (reply[3] ?? []) as string[];
    const failed = new Map<string, string>();
    for (let i = 0; i < failedFlat.length; i += 2) failed.set(String(failedFlat[i]), String(failedFlat[i + 1]));
    return {
      moved: null,
      scheduled: Number(reply[1]),
      failed,
      asked: ((reply[4] ?? []) as unknown[]).map(String),
      seq: Number(reply[5] ?? 0),
      transit: ((reply[6] ?? []) as unknown[]).map(String),
    };
  }

  /** Drop the keys' pending refreshes; each key's state found, the tokens, the bundles in transit. */
  async cancel(shard: ShardKeys, groups: { rule: string; keys: string[] }[], nodeId: string,
               history: number): Promise<{ states: string[]; seq: number; transit: string[] }> {
    const keys = [shard.meta, shard.history, shard.moving, shard.seq];
    const args: (string | number)[] = [nodeId, history, shard.itemsPrefix, shard.claimedPrefix,
      shard.tracesPrefix];
    for (const g of groups) {
      keys.push(shard.due(g.rule));
      args.push(g.rule, g.keys.length, g.keys.join(KEY_SEPARATOR));
    }
    const reply = (await this.run("cancel", keys, args)) as unknown[];
    const states = (reply[1] as unknown[]).map(String);
    const total = groups.reduce((n, g) => n + g.keys.length, 0);
    if (states.length !== total) throw new ScriptError(`cancel answered ${JSON.stringify(reply)} for ${total} keys`);
    return { states, seq: Number(reply[2]), transit: ((reply[3] ?? []) as unknown[]).map(String) };
  }

  /** Count the shard's pending keys; trim its dead letters (limits.lua). */
  async limits(shard: ShardKeys, rules: string[], keepDead: number, deadTtlMs: number,
               budget: number): Promise<LimitsAnswer> {
    const keys = [shard.meta, ...rules.map((r) => shard.due(r)), ...rules.map((r) => shard.dead(r))];
    const reply = (await this.run("limits", keys, [rules.length, shard.itemsPrefix,
      shard.claimedPrefix, keepDead, deadTtlMs, budget, shard.tracesPrefix])) as unknown[];
    const [pending, byAge, byCount, dead] = reply.map(Number);
    return { pending, byAge, byCount, dead };
  }

  /** The bytes the shard holds for its keys (pending_bytes.lua), a page at a time. */
  async pendingBytes(shard: ShardKeys, items: boolean, page: number): Promise<[number, boolean]> {
    const reply = (await this.run("pending_bytes", [shard.meta, shard.bytes],
      [items ? shard.itemsPrefix : "", items ? shard.claimedPrefix : "", shard.tracesPrefix,
        page])) as unknown[];
    return [Number(reply[0]), Number(reply[1]) === 1];
  }

  /** The namespace's shard layout, created with `shards` when there is none. */
  async layout(namespace: string, shards: number): Promise<Layout> {
    const reply = (await this.run("layout", [layoutKey(namespace), drainedKey(namespace)],
      [shards])) as unknown[];
    return { gen: Number(reply[0]), shards: Number(reply[1]), source: Number(reply[2]) };
  }

  /** Put bundles taken from an old shard into their new shard (a reshard's keys in
   * transit, which a writer that meets them carries, as store/layout.py's carry does). */
  async reshardPut(shard: ShardKeys, sourceSeq: number, bundles: string[]): Promise<number> {
    return Number(await this.run("reshard_put",
      [shard.meta, shard.seq, shard.nextWake, shard.ruleNames, shard.arrived],
      [shard.wakeChannel, shard.prefix, sourceSeq, ...bundles]));
  }

  /** Carry bundles in transit into their new shards of `space`. */
  async carry(space: KeySpace, sourceSeq: number, bundles: string[]): Promise<void> {
    const byShard = new Map<number, string[]>();
    for (const b of bundles) {
      const n = Number((JSON.parse(b) as { d: number }).d);
      byShard.set(n, [...(byShard.get(n) ?? []), b]);
    }
    await Promise.all([...byShard].map(([n, part]) => this.reshardPut(space.shard(n), sourceSeq, part)));
  }
}

function timesOf(g: UpsertGroup): string {
  if (!g.schedules) return "";
  const out: string[] = [];
  for (const [key, spec] of g.schedules) out.push(key, spec);
  return out.join(KEY_SEPARATOR);
}

function itemsSection(groups: UpsertGroup[]): (string | number)[] {
  const args: (string | number)[] = [];
  for (const g of groups) {
    if (!g.items || g.items.size === 0) continue;
    const fields: string[] = [];
    for (const [key, items] of g.items) fields.push(key, String(items.length), ...items);
    args.push(g.itemsMax, fields.join(KEY_SEPARATOR));
  }
  return args;
}

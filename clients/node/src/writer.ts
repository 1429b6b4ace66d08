/**
 * The in-process buffer between touch() and Redis, and the writes that empty it: the
 * Python writer's absorber and flusher (coalescer/write/) in one event loop.
 *
 * A touched key waits in `pending` until a write takes it; more touches of it meanwhile
 * cost one Map lookup (absorbed: the write that follows carries them all, and Redis
 * stamps its own time on it). Keys are sent as soon as a write has room (at most
 * MAX_IN_FLIGHT writes at once), one upsert.lua call per shard and at most
 * MAX_KEYS_PER_CALL keys, the calls of a tick pipelined by ioredis. A key written
 * lately is held for its rule's `absorb` interval, and one still being written until
 * that write ends, so a hot key costs at most one Redis write per interval.
 *
 * A write that fails for a reason not about a key (the connection, an error reply such
 * as MISCONF, READONLY, OOM or NOREPLICAS) gives its keys back, losing nothing, and the
 * writes are retried with backoff; a write that fails for a key's own sake is split in
 * halves until the keys Redis refuses are found, which alone are dropped.
 */
import { BackpressureError, ReplicationError, shown } from "./errors.js";
import { ms } from "./durations.js";
import { classify, writeError } from "./failures.js";
import type { KeySpace } from "./keys.js";
import type { Rule } from "./rules.js";
import { thenPlain } from "./schedule.js";
import { MAX_GROUPS, type Scripts, type UpsertGroup, type UpsertResult } from "./scripts.js";

export const MAX_IN_FLIGHT = 2;
export const MAX_KEYS_PER_CALL = 500; // each upsert call holds Redis about 1-2 ms at most
export const MAX_ITEMS_PER_CALL = 5_000;
const FLUSH_ROUNDS = 3;
const MAX_REROUTES = 3;
const FORGET_ROUNDS = 5;
const BACKOFF_FIRST = 50;
const BACKOFF_MOST = 2000;
export const OVERFLOW = "";

export interface DroppedKey { key: string; error: string; at: number }

/** What the writer needs of its owner: the layout it writes with, and replicas. */
export interface WriterHost {
  keyspace(): KeySpace;
  /** Read the layout again (one newer than `gen` when given); the new key space. */
  refreshLayout(newerThan?: number): Promise<KeySpace>;
  /** Wait for the replicas after a write (nothing without `durability.replicas`). */
  confirm(): Promise<void>;
  log(level: "error" | "warn" | "info", message: string): void;
}

class Batch {
  rules = new Map<string, Rule>();
  items: Map<string, Set<string>> | null = null;
  schedules: Map<string, string> | null = null;
}

type Call = { shard: number; groups: UpsertGroup[] };

function addItem(bag: Set<string>, item: string, most: number): number {
  if (bag.has(item)) return 0;
  if (bag.size - (bag.has(OVERFLOW) ? 1 : 0) < most) {
    bag.add(item);
    return 1;
  }
  if (bag.has(OVERFLOW)) return 0;
  bag.add(OVERFLOW);
  return 1;
}

export class Writer {
  private pending = new Map<string, Rule>();
  private items = new Map<string, Set<string>>();
  private schedules = new Map<string, string>();
  private itemCount = 0;
  // written lately: each write's keys, with when it ended (performance.now(), ms); a key
  // of one of them is held until its rule's absorb has passed since
  private recent: { rules: Map<string, Rule>; at: number }[] = [];
  private readonly writing: Batch[] = []; // batches taken and not yet finished
  private taken = 0; // keys of those batches
  private readonly maxAbsorb: number; // ms
  private readonly writes = new Set<Promise<void>>(); // every write not yet ended
  private running = 0; // the background loop's writes in flight
  private scheduled = false;
  private timer: NodeJS.Timeout | null = null;
  private backoff = 0;
  private backoffUntil = 0;
  private stopped = false;
  /** why the background loop's last write failed (null once one succeeds) */
  lastFailure: Error | null = null;
  readonly dropped: DroppedKey[] = [];
  /** touches accepted; of them absorbed into a buffered key; keys written */
  touches = 0;
  absorbed = 0;
  written = 0;

  constructor(private readonly scripts: Scripts, private readonly host: WriterHost,
              readonly maxKeys: number, rules: readonly Rule[], readonly maxItems = maxKeys * 10) {
    this.maxAbsorb = Math.max(0, ...rules.map((r) => r.absorb * 1000));
  }

  /** Keys accepted and not yet in Redis. */
  get size(): number {
    return this.pending.size + this.taken;
  }

  // -- touching -----------------------------------------------------------------------

  /** Buffer a plain touch of `key`; `rule(key)` checks a key not buffered yet and
   * returns its rule (it throws for a refused key, which is then not counted). */
  touch(key: string, rule: (key: string) => Rule): void {
    if (this.pending.has(key)) {
      this.touches++;
      this.absorbed++;
      if (this.schedules.size > 0) {
        const old = this.schedules.get(key);
        if (old !== undefined) this.schedules.set(key, thenPlain(old));
      }
      return;
    }
    const found = rule(key);
    if (this.pending.size + this.taken >= this.maxKeys) throw this.full(key);
    this.touches++;
    this.pending.set(key, found);
    this.kick();
  }

  /** Buffer every touch or none: (key, rule, item or null), all with time `spec`. */
  touchAll(touches: [string, Rule, string | null][], spec: string | null): void {
    const fresh = new Set<string>();
    let withItems = 0;
    for (const [key, , item] of touches) {
      if (!this.pending.has(key)) fresh.add(key);
      if (item !== null) withItems++;
    }
    if (fresh.size > 0 && this.pending.size + this.taken + fresh.size > this.maxKeys) {
      throw this.full(touches[0][0], fresh.size);
    }
    if (withItems > 0 && this.itemCount + withItems > this.maxItems) {
      throw new BackpressureError(`touch refused: ${withItems} items do not fit: ` +
        `${this.itemCount} items are buffered and not yet written to Redis (at most ${this.maxItems})`);
    }
    for (const [key, rule, item] of touches) {
      this.touches++;
      if (this.pending.has(key)) this.absorbed++;
      else this.pending.set(key, rule);
      if (item !== null) {
        let bag = this.items.get(key);
        if (bag === undefined) this.items.set(key, (bag = new Set()));
        this.itemCount += addItem(bag, item, rule.itemsMax ?? 0);
      }
      if (spec !== null) this.schedules.set(key, spec);
      else if (this.schedules.size > 0) {
        const old = this.schedules.get(key);
        if (old !== undefined) this.schedules.set(key, thenPlain(old));
      }
    }
    if (touches.length > 0) this.kick();
  }

  private full(key: string, n = 1): BackpressureError {
    const why = this.lastFailure ? this.lastFailure.message : "is Redis reachable, or keeping up?";
    return new BackpressureError(`touch of ${n === 1 ? `key ${shown(key)}` : `${n} new keys`} ` +
      `refused: ${this.size} keys are buffered and not yet written to Redis, at most ` +
      `${this.maxKeys} (${why})`);
  }

  // -- the background loop ------------------------------------------------------------

  private kick(): void {
    if (this.scheduled || this.stopped) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      this.pump();
    });
  }

  private pump(): void {
    if (this.stopped) return;
    const now = performance.now();
    if (now < this.backoffUntil) {
      this.wakeAt(this.backoffUntil - now);
      return;
    }
    while (this.running < MAX_IN_FLIGHT && this.pending.size > 0) {
      const batch = this.take(false);
      if (batch.rules.size === 0) break;
      this.running++;
      this.start(batch).then(() => {
        this.backoff = 0;
        this.lastFailure = null;
      }, (e: unknown) => {
        this.lastFailure = writeError(e);
        this.backoff = Math.min(BACKOFF_MOST, this.backoff ? this.backoff * 2 : BACKOFF_FIRST);
        this.backoffUntil = performance.now() + this.backoff;
        this.host.log("warn", `${batch.rules.size} keys not written yet: ${this.lastFailure.message}`);
      }).finally(() => {
        this.running--;
        this.pump();
      });
    }
    const wait = this.nextReadyIn();
    if (wait !== null) this.wakeAt(wait);
  }

  private wakeAt(ms: number): void {
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      this.timer = null;
      this.pump();
    }, Math.max(1, Math.ceil(ms)));
    this.timer.unref();
  }

  /** ms until a held key may be written; null when none is held (or all wait for a
   * write in flight, whose end pumps again). */
  private nextReadyIn(): number | null {
    if (this.pending.size === 0 || this.recent.length === 0) return null;
    const now = performance.now();
    let soonest: number | null = null;
    for (const [key, rule] of this.pending) {
      if (this.inFlight(key)) continue;
      const until = this.heldUntil(key, rule);
      if (until <= now) return 0;
      soonest = soonest === null ? until - now : Math.min(soonest, until - now);
    }
    return soonest;
  }

  private inFlight(key: string): boolean {
    for (const b of this.writing) if (b.rules.has(key)) return true;
    return false;
  }

  /** When `key` (of `rule`) may be written again (0: now). */
  private heldUntil(key: string, rule: Rule): number {
    const absorb = rule.absorb * 1000;
    for (let i = this.recent.length - 1; i >= 0; i--) {
      const r = this.recent[i];
      if (r.rules.has(key)) return r.at + absorb;
    }
    return 0;
  }

  /** Remove and return the keys ready to write (every one with `everything`). */
  private take(everything: boolean): Batch {
    const batch = new Batch();
    const now = performance.now();
    this.pruneRecent(now);
    if (everything || (this.recent.length === 0 && this.writing.length === 0)) {
      batch.rules = this.pending;
      this.pending = new Map();
    } else {
      for (const [key, rule] of this.pending) {
        if (this.inFlight(key) || this.heldUntil(key, rule) > now) continue;
        batch.rules.set(key, rule);
      }
      if (batch.rules.size === this.pending.size) this.pending = new Map();
      else for (const key of batch.rules.keys()) this.pending.delete(key);
    }
    if (this.items.size > 0) {
      batch.items = this.takeFrom(this.items, batch, (m) => { this.items = m; });
      for (const its of batch.items.values()) this.itemCount -= its.size;
    }
    if (this.schedules.size > 0) {
      batch.schedules = this.takeFrom(this.schedules, batch, (m) => { this.schedules = m; });
    }
    return batch;
  }

  private takeFrom<V>(from: Map<string, V>, batch: Batch, replace: (m: Map<string, V>) => void): Map<string, V> {
    if (this.pending.size === 0) {
      replace(new Map());
      return from;
    }
    const out = new Map<string, V>();
    for (const [key, v] of from) {
      if (batch.rules.has(key)) {
        out.set(key, v);
        from.delete(key);
      }
    }
    return out;
  }

  private pruneRecent(now: number): void {
    let drop = 0;
    while (drop < this.recent.length && this.recent[drop].at + this.maxAbsorb <= now) drop++;
    if (drop > 0) this.recent = this.recent.slice(drop);
  }

  // -- writes -------------------------------------------------------------------------

  private start(batch: Batch): Promise<void> {
    this.writing.push(batch);
    this.taken += batch.rules.size;
    const write = this.send(batch).then(() => {
      if (this.maxAbsorb > 0) this.recent.push({ rules: batch.rules, at: performance.now() });
    }).finally(() => {
      this.writing.splice(this.writing.indexOf(batch), 1);
      this.taken -= batch.rules.size;
      this.writes.delete(write);
    });
    this.writes.add(write);
    write.catch(() => undefined); // its error is the loop's or flush()'s
    return write;
  }

  private async send(batch: Batch): Promise<void> {
    let space: KeySpace;
    let calls: Call[];
    try {
      space = this.host.keyspace();
      calls = this.calls(batch, space);
    } catch (e) {
      this.giveBack(batch.rules, batch.items, batch.schedules);
      throw e;
    }
    await this.deliverAll(space, 0, 0, calls, batch);
    try {
      await this.host.confirm();
    } catch (e) {
      if (e instanceof ReplicationError) this.giveBack(batch.rules, batch.items, batch.schedules);
      throw e;
    }
  }

  private calls(batch: Batch, space: KeySpace): Call[] {
    const byShard = new Map<number, Map<Rule, string[]>>();
    const one = space.span === 1;
    for (const [key, rule] of batch.rules) {
      const shard = one ? 0 : space.resharding ? space.sourceOf(key) : space.shardOf(key);
      let byRule = byShard.get(shard);
      if (byRule === undefined) byShard.set(shard, (byRule = new Map()));
      let keys = byRule.get(rule);
      if (keys === undefined) byRule.set(rule, (keys = []));
      keys.push(key);
    }
    const out: Call[] = [];
    for (const [shard, byRule] of byShard) {
      for (const groups of this.split(byRule, batch)) {
        out.push({ shard, groups: markHeld(space, shard, groups) });
      }
    }
    return out;
  }

  /** One shard's keys as calls of at most MAX_KEYS_PER_CALL keys, and keys with their
   * items at most MAX_ITEMS_PER_CALL (a key's items are never split). */
  private *split(byRule: Map<Rule, string[]>, batch: Batch): Generator<UpsertGroup[]> {
    let call: UpsertGroup[] = [];
    let keysIn = 0;
    let weight = 0;
    for (const [rule, keys] of byRule) {
      let part: string[] = [];
      if (call.length >= MAX_GROUPS) {
        yield call;
        call = [];
        keysIn = 0;
        weight = 0;
      }
      for (const key of keys) {
        const cost = 1 + (batch.items?.get(key)?.size ?? 0);
        if ((keysIn >= MAX_KEYS_PER_CALL || weight + cost > MAX_ITEMS_PER_CALL) && keysIn > 0) {
          if (part.length > 0) call.push(group(rule, part, batch));
          yield call;
          call = [];
          part = [];
          keysIn = 0;
          weight = 0;
        }
        part.push(key);
        keysIn++;
        weight += cost;
      }
      if (part.length > 0) call.push(group(rule, part, batch));
    }
    if (call.length > 0) yield call;
  }

  private async deliverAll(space: KeySpace, reroutes: number, minSeq: number, calls: Call[],
                           batch: Batch): Promise<void> {
    const results = await Promise.allSettled(
      calls.map((c) => this.deliver(space, reroutes, minSeq, c.shard, c.groups, batch)));
    for (const r of results) if (r.status === "rejected") throw r.reason;
  }

  private async deliver(space: KeySpace, reroutes: number, minSeq: number, shard: number,
                        groups: UpsertGroup[], batch: Batch): Promise<void> {
    let result: UpsertResult;
    try {
      result = await this.scripts.upsert(space.shard(shard), groups, space.gen, minSeq);
    } catch (e) {
      if (classify(e) !== "key") {
        this.giveBackGroups(groups, batch);
        throw e;
      }
      await this.bisect(space, reroutes, minSeq, shard, groups, batch, e);
      return;
    }
    if (result.moved !== null) {
      let newer: KeySpace;
      try {
        if (reroutes >= MAX_REROUTES) throw new Error(`shard ${shard} follows layout generation ${result.moved}`);
        newer = await this.host.refreshLayout(space.gen);
      } catch (e) {
        this.giveBackGroups(groups, batch);
        throw e;
      }
      await this.deliverAll(newer, reroutes + 1, 0, route(newer, groups), batch);
      return;
    }
    const asked = new Set(result.asked);
    for (const [key, error] of result.failed) this.drop(key, error);
    this.written += groups.reduce((n, g) => n + g.keys.length, 0) - result.failed.size - asked.size;
    if (asked.size > 0) {
      const calls = routeAsked(space, groups, asked);
      if (result.transit.length > 0) {
        try {
          await this.scripts.carry(space, result.seq, result.transit);
        } catch (e) {
          for (const c of calls) this.giveBackGroups(c.groups, batch);
          throw e;
        }
      }
      await this.deliverAll(space, reroutes, result.seq, calls, batch);
    }
  }

  private async bisect(space: KeySpace, reroutes: number, minSeq: number, shard: number,
                       groups: UpsertGroup[], batch: Batch, error: unknown): Promise<void> {
    const total = groups.reduce((n, g) => n + g.keys.length, 0);
    if (total === 1) {
      this.drop(groups[0].keys[0], error instanceof Error ? error.message : String(error));
      return;
    }
    const [first, second] = halves(groups, Math.floor(total / 2));
    try {
      await this.deliver(space, reroutes, minSeq, shard, first, batch);
    } catch (e) {
      this.giveBackGroups(second, batch);
      throw e;
    }
    await this.deliver(space, reroutes, minSeq, shard, second, batch);
  }

  private drop(key: string, error: string): void {
    this.host.log("error", `dropped key ${shown(key)}, Redis cannot store it: ${error}`);
    this.dropped.push({ key, error, at: Date.now() });
    if (this.dropped.length > 20) this.dropped.shift();
  }

  private giveBackGroups(groups: UpsertGroup[], batch: Batch): void {
    const rules = new Map<string, Rule>();
    for (const g of groups) for (const key of g.keys) rules.set(key, batch.rules.get(key)!);
    this.giveBack(rules, batch.items, batch.schedules);
  }

  /** Unwritten keys (with their items and times) go back to the buffer: nothing
   * accepted is lost. A newer time wins; a plain touch since follows the old one. */
  private giveBack(rules: Map<string, Rule>, items: Map<string, Set<string>> | null,
                   schedules: Map<string, string> | null): void {
    for (const [key, rule] of rules) {
      const spec = schedules?.get(key);
      if (spec !== undefined && !this.schedules.has(key)) {
        this.schedules.set(key, this.pending.has(key) ? thenPlain(spec) : spec);
      }
      if (!this.pending.has(key)) this.pending.set(key, rule);
      const its = items?.get(key);
      if (its !== undefined) {
        let bag = this.items.get(key);
        if (bag === undefined) this.items.set(key, (bag = new Set()));
        for (const item of its) this.itemCount += addItem(bag, item, rule.itemsMax ?? its.size);
      }
    }
  }

  // -- flush, cancel, close -------------------------------------------------------------

  /** Resolves once Redis holds every touch buffered before the call; rejects with
   * RedisUnreachableError or RedisRefusesWritesError (the keys stay buffered, and the
   * background loop goes on writing them). */
  async flush(): Promise<void> {
    let earlier = [...this.writes];
    let failure: unknown = null;
    for (let round = 0; round < FLUSH_ROUNDS; round++) {
      if (this.pending.size > 0) earlier.push(this.start(this.take(true)));
      const results = await Promise.allSettled(earlier);
      const failed = results.find((r) => r.status === "rejected") as PromiseRejectedResult | undefined;
      if (failed === undefined) return;
      failure = failed.reason;
      earlier = [...this.writes];
    }
    if (failure !== null) throw writeError(failure);
  }

  /** Drop the buffered touches of `keys` and wait until no write in flight carries one;
   * the keys that had buffered touches. */
  async forget(keys: Set<string>): Promise<Set<string>> {
    const dropped = new Set<string>();
    for (let round = 0; round < FORGET_ROUNDS; round++) {
      for (const key of keys) {
        if (this.pending.delete(key)) dropped.add(key);
        const its = this.items.get(key);
        if (its !== undefined) {
          this.itemCount -= its.size;
          this.items.delete(key);
        }
        this.schedules.delete(key);
      }
      const busy = [...keys].some((k) => this.inFlight(k));
      if (!busy) break;
      await Promise.allSettled([...this.writes]);
    }
    return dropped;
  }

  /** The keys accepted and not yet in Redis. */
  unwrittenKeys(): string[] {
    const keys = new Set(this.pending.keys());
    for (const b of this.writing) for (const k of b.rules.keys()) keys.add(k);
    return [...keys].sort();
  }

  stop(): void {
    this.stopped = true;
    if (this.timer !== null) clearTimeout(this.timer);
  }

  /** Wait for the writes in flight to end. */
  async settle(): Promise<void> {
    await Promise.allSettled([...this.writes]);
  }
}

function group(rule: Rule, keys: string[], batch: Batch): UpsertGroup {
  let items: Map<string, string[]> | null = null;
  if (batch.items) {
    for (const key of keys) {
      const its = batch.items.get(key);
      if (its !== undefined) (items ??= new Map()).set(key, [...its]);
    }
  }
  let schedules: Map<string, string> | null = null;
  if (batch.schedules) {
    for (const key of keys) {
      const spec = batch.schedules.get(key);
      if (spec !== undefined) (schedules ??= new Map()).set(key, spec);
    }
  }
  return { rule: rule.name, windowMs: ms(rule.window), maxWaitMs: ms(rule.maxWait), keys, held: false, items,
           itemsMax: rule.itemsMax ?? 0, leading: rule.leading, schedules };
}

/** `g` with only `keys` (and their items and times). */
function part(g: UpsertGroup, keys: string[], held = g.held): UpsertGroup {
  const pick = <V>(m: Map<string, V> | null): Map<string, V> | null => {
    if (!m) return null;
    const out = new Map<string, V>();
    for (const k of keys) if (m.has(k)) out.set(k, m.get(k)!);
    return out.size > 0 ? out : null;
  };
  return { ...g, keys, held, items: pick(g.items), schedules: pick(g.schedules) };
}

function halves(groups: UpsertGroup[], n: number): [UpsertGroup[], UpsertGroup[]] {
  const first: UpsertGroup[] = [];
  const second: UpsertGroup[] = [];
  for (const g of groups) {
    const cut = Math.max(0, Math.min(g.keys.length, n));
    if (cut > 0) first.push(part(g, g.keys.slice(0, cut)));
    if (cut < g.keys.length) second.push(part(g, g.keys.slice(cut)));
    n -= cut;
  }
  return [first, second];
}

/** Groups bound for old shard `shard`, split into the keys whose new shard it is too
 * and the held ones (a reshard runs; see coalescer/write/routing.py). */
function markHeld(space: KeySpace, shard: number, groups: UpsertGroup[]): UpsertGroup[] {
  if (!space.resharding) return groups;
  const out: UpsertGroup[] = [];
  for (const g of groups) {
    const home = g.keys.filter((k) => space.shardOf(k) === shard);
    const held = home.length > 0 ? g.keys.filter((k) => space.shardOf(k) !== shard) : g.keys;
    if (home.length > 0) out.push(part(g, home, false));
    if (held.length > 0) out.push(part(g, held, true));
  }
  return out;
}

function route(space: KeySpace, groups: UpsertGroup[]): Call[] {
  const byShard = new Map<number, UpsertGroup[]>();
  for (const g of groups) {
    const parts = new Map<number, string[]>();
    for (const key of g.keys) {
      const s = space.sourceOf(key);
      parts.set(s, [...(parts.get(s) ?? []), key]);
    }
    for (const [s, keys] of parts) {
      byShard.set(s, [...(byShard.get(s) ?? []), ...markHeld(space, s, [part(g, keys, false)])]);
    }
  }
  return [...byShard].map(([shard, gs]) => ({ shard, groups: gs }));
}

function routeAsked(space: KeySpace, groups: UpsertGroup[], asked: Set<string>): Call[] {
  const byShard = new Map<number, UpsertGroup[]>();
  for (const g of groups) {
    const parts = new Map<number, string[]>();
    for (const key of g.keys) {
      if (!asked.has(key)) continue;
      const s = space.shardOf(key);
      parts.set(s, [...(parts.get(s) ?? []), key]);
    }
    for (const [s, keys] of parts) byShard.set(s, [...(byShard.get(s) ?? []), part(g, keys, false)]);
  }
  return [...byShard].map(([shard, gs]) => ({ shard, groups: gs }));
}

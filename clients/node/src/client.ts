/**
 * `Coalescer`: a writer of touches for a coalescer deployment, from Node.js. It does
 * what the Python writer (`Coalescer.from_yaml(..., worker=False)`) does: touches are
 * absorbed in process and written in pipelined Lua calls, and `flush()` resolves once
 * Redis holds them. It never runs handlers: a Python node does.
 */
import { hostname } from "node:os";
import { Cluster, Redis, type RedisOptions } from "ioredis";
import { checkItem, checkKey } from "./check.js";
import {
  ClosedError, InvalidScheduleError, ReplicationError, UnwrittenTouchesError,
} from "./errors.js";
import { checkEviction } from "./eviction.js";
import { KeySpace } from "./keys.js";
import { checkVersion } from "./protocol.js";
import { Quota } from "./quota.js";
import { type Config, type Rule, loadRules, parseRules, ruleFor } from "./rules.js";
import { type At, type Delay, scheduleSpec } from "./schedule.js";
import { type Client, MAX_GROUPS, Scripts } from "./scripts.js";
import { Writer } from "./writer.js";

export type Logger = (level: "error" | "warn" | "info", message: string) => void;

export interface CoalescerOptions {
  /** The rules file's path, its YAML text (`rulesYaml`) or a parsed Config. */
  rules?: string;
  rulesYaml?: string;
  config?: Config;
  /** redis:// or rediss:// URL of the server, or of any node of a Redis Cluster (detected
   * with INFO cluster); default `$COALESCER_REDIS_URL`, else redis://127.0.0.1:6379/0. */
  redisUrl?: string;
  /** Keys buffered at most before touch() refuses (BackpressureError); default 100,000. */
  maxBuffered?: number;
  /** Who cancels, in the history of cancelled keys; default HOST:PID. */
  nodeId?: string;
  /** Refuse a server whose maxmemory-policy may evict coalescer's keys (default true). */
  refuseEvictingPolicy?: boolean;
  /** Extra ioredis options (timeouts, TLS, ...). */
  redisOptions?: RedisOptions;
  logger?: Logger;
}

export interface TouchOptions {
  /** Due at exactly this time: a Date, epoch seconds, or ISO-8601 text with an offset. */
  at?: At;
  /** Due this long after Redis takes the touch: seconds, or a duration string ("30m"). */
  delay?: Delay;
  /** A schedule keeps the items the key had (it drops them otherwise). */
  keepItems?: boolean;
}

export interface CancelOutcome {
  /** the keys whose refresh was dropped */
  cancelled: string[];
  /** idle, dead-lettered, or running with nothing queued after it */
  notPending: string[];
  /** each key's state: pending, rearm, buffered, running, dead, idle */
  states: Record<string, string>;
}

const DROPPED = new Set(["pending", "rearm", "buffered"]);
const CANCEL_BATCH = 500;

const defaultLogger: Logger = (level, message) => {
  if (level !== "info") console.error(`coalescer: ${message}`);
};

export class Coalescer {
  readonly config: Config;
  private redis: Client | null = null;
  private scripts: Scripts | null = null;
  private writer: Writer | null = null;
  private quota: Quota | null = null;
  private space: KeySpace;
  private closed = false;
  private readonly log: Logger;
  private readonly nodeId: string;
  /** the protocol version the namespace follows, read at start */
  protocolVersion: string | null = null;

  constructor(private readonly options: CoalescerOptions) {
    if (options.config) this.config = options.config;
    else if (options.rulesYaml !== undefined) this.config = parseRules(options.rulesYaml);
    else this.config = loadRules(options.rules ?? "rules.yaml");
    this.log = options.logger ?? defaultLogger;
    this.nodeId = options.nodeId ?? `${hostname()}:${process.pid}`;
    this.space = new KeySpace(this.config.namespace, this.config.shards);
  }

  /** Build and start a client (see `start`). */
  static async connect(options: CoalescerOptions): Promise<Coalescer> {
    const c = new Coalescer(options);
    await c.start();
    return c;
  }

  /** Connect; refuse an evicting maxmemory-policy (EvictionPolicyError) and a protocol
   * version of another major (ProtocolVersionError); read the shard layout. */
  async start(): Promise<void> {
    if (this.redis !== null) return;
    const url = this.options.redisUrl ?? process.env.COALESCER_REDIS_URL ?? "redis://127.0.0.1:6379/0";
    const redis = await connect(url, this.options.redisOptions ?? {});
    try {
      if (this.options.refuseEvictingPolicy ?? true) await checkEviction(redis);
      this.protocolVersion = await checkVersion(redis, this.config.namespace,
        (m) => this.log("warn", m));
      this.scripts = new Scripts(redis, this.config.rules.length);
      const layout = await this.scripts.layout(this.config.namespace, this.config.shards);
      this.space = new KeySpace(this.config.namespace, layout.shards, layout.source, layout.gen);
    } catch (e) {
      redis.disconnect();
      throw e;
    }
    this.redis = redis;
    const scripts = this.scripts;
    this.writer = new Writer(scripts, {
      keyspace: () => this.space,
      refreshLayout: async () => {
        const l = await scripts.layout(this.config.namespace, this.config.shards);
        this.space = new KeySpace(this.config.namespace, l.shards, l.source, l.gen);
        return this.space;
      },
      confirm: () => this.confirm(),
      log: this.log,
    }, this.options.maxBuffered ?? 100_000, this.config.rules);
    const writer = this.writer;
    this.quota = new Quota(this.config, scripts, () => this.space, () => writer.touches,
      (m) => this.log("warn", m));
    this.quota.start();
  }

  private running(what: string): Writer {
    if (this.writer === null || this.closed) {
      throw new ClosedError(`${what} on a coalescer that is ${this.closed ? "closed" : "not started (await start())"}`);
    }
    return this.writer;
  }

  private async confirm(): Promise<void> {
    const wanted = this.config.replicas;
    if (wanted === 0 || this.redis === null || this.redis instanceof Cluster) return;
    const got = Number(await this.redis.wait(wanted, Math.round(this.config.replicaTimeout * 1000)));
    if (got < wanted) throw new ReplicationError(got, wanted);
  }

  private readonly ruleOfKey = (key: string): Rule => this.ruleOf(key);

  /** The rule of `key` (UnknownKeyError when none matches, InvalidKeyError when Redis
   * cannot store it). */
  ruleOf(key: string): Rule {
    checkKey(key);
    return ruleFor(this.config, key);
  }

  private spec(key: string, options?: TouchOptions): string | null {
    if (!options || (options.at === undefined && options.delay === undefined)) {
      if (options?.keepItems) throw new InvalidScheduleError(key, options, "keepItems goes with at or delay");
      return null;
    }
    return scheduleSpec(key, options.at, options.delay, this.config.limits.maxScheduleAhead,
      options.keepItems ?? false);
  }

  /**
   * Mark `key` stale: its rule's handler runs once, a quiet window later (on a Python
   * node). Synchronous: the touch is buffered and written within the rule's `absorb`.
   * With `item`, the refresh's `claim.items` holds it (the rule needs `items:`). With
   * `at`/`delay`, the key is due at exactly that time (the Redis server's clock).
   * Throws UnknownKeyError, InvalidKeyError, InvalidItemError, InvalidScheduleError,
   * BackpressureError (QuotaExceededError), ClosedError; nothing is touched then.
   */
  touch(key: string, item?: string | null, options?: TouchOptions): void {
    const writer = this.running("touch()");
    this.quota?.check();
    if ((item === undefined || item === null) && options === undefined) {
      writer.touch(key, this.ruleOfKey);
      return;
    }
    const rule = this.ruleOf(key);
    if (item !== undefined && item !== null) checkItem(key, item, rule.name, rule.itemsMax !== null);
    writer.touchAll([[key, rule, item ?? null]], this.spec(key, options));
  }

  /** Touch every key or none (the errors of `touch`); `options` apply to each. */
  touchMany(keys: Iterable<string>, options?: TouchOptions): void {
    const writer = this.running("touchMany()");
    this.quota?.check();
    const list = [...keys];
    const touches = list.map((k): [string, Rule, null] => [k, this.ruleOf(k), null]);
    const spec = list.length > 0 ? this.spec(list[0], options) : null;
    writer.touchAll(touches, spec);
  }

  /** Touch each key of the (key, item) pairs with its item, and each of `keys` plainly:
   * every one or none. */
  touchItems(pairs: Iterable<[string, string]>, options?: TouchOptions & { keys?: Iterable<string> }): void {
    const writer = this.running("touchItems()");
    this.quota?.check();
    const touches: [string, Rule, string | null][] = [];
    for (const [key, item] of pairs) {
      const rule = this.ruleOf(key);
      checkItem(key, item, rule.name, rule.itemsMax !== null);
      touches.push([key, rule, item]);
    }
    for (const key of options?.keys ?? []) touches.push([key, this.ruleOf(key), null]);
    const spec = touches.length > 0 ? this.spec(touches[0][0], options) : null;
    writer.touchAll(touches, spec);
  }

  /** Resolves once Redis holds every touch made before the call. Rejects with
   * RedisRefusesWritesError (its `replyCode`: MISCONF, OOM, NOREPLICAS, ...) or
   * RedisUnreachableError; the touches stay buffered and are written later. */
  async flush(): Promise<void> {
    await this.running("flush()").flush();
  }

  /** Drop `key`'s pending refresh; see `cancelMany`. */
  async cancel(key: string): Promise<CancelOutcome> {
    return this.cancelMany([key]);
  }

  /**
   * Drop the keys' pending refreshes: touches made before the call are not refreshed; a
   * touch after it arms its key again. A running key's refresh finishes, but the re-run
   * its touches during the run queued is dropped. Buffered touches are dropped too.
   */
  async cancelMany(keys: Iterable<string>): Promise<CancelOutcome> {
    const writer = this.running("cancel()");
    const list = [...new Set(keys)];
    const rules = new Map(list.map((k) => [k, this.ruleOf(k).name]));
    const buffered = await writer.forget(new Set(list));
    const space = this.space;
    const { found, seq, transit } = await this.cancelIn(space, rules, (k) => space.sourceOf(k));
    if (space.resharding) {
      if (transit.length > 0) await this.scripts!.carry(space, seq, transit);
      const moved = new Map([...rules].filter(([k]) => found.get(k) === "idle" &&
        space.shardOf(k) !== space.sourceOf(k)));
      if (moved.size > 0) {
        for (const [k, v] of (await this.cancelIn(space, moved, (k) => space.shardOf(k))).found) found.set(k, v);
      }
    }
    const outcome: CancelOutcome = { cancelled: [], notPending: [], states: {} };
    for (const key of list) {
      let state = found.get(key)!;
      if (!DROPPED.has(state) && buffered.has(key)) state = "buffered";
      outcome.states[key] = state;
      (DROPPED.has(state) ? outcome.cancelled : outcome.notPending).push(key);
    }
    return outcome;
  }

  private async cancelIn(space: KeySpace, rules: Map<string, string>, shardOf: (k: string) => number):
      Promise<{ found: Map<string, string>; seq: number; transit: string[] }> {
    const byShard = new Map<number, string[]>();
    for (const key of rules.keys()) {
      const s = shardOf(key);
      byShard.set(s, [...(byShard.get(s) ?? []), key]);
    }
    const calls: Promise<{ names: string[]; states: string[]; seq: number; transit: string[] }>[] = [];
    for (const [shard, keys] of byShard) {
      for (let i = 0; i < keys.length; i += CANCEL_BATCH) {
        const byRule = new Map<string, string[]>();
        for (const key of keys.slice(i, i + CANCEL_BATCH)) {
          const r = rules.get(key)!;
          byRule.set(r, [...(byRule.get(r) ?? []), key]);
        }
        const all = [...byRule].map(([rule, ks]) => ({ rule, keys: ks }));
        for (let j = 0; j < all.length; j += MAX_GROUPS) {
          const groups = all.slice(j, j + MAX_GROUPS);
          calls.push(this.scripts!.cancel(space.shard(shard), groups, this.nodeId, this.config.history)
            .then((a) => ({ ...a, names: groups.flatMap((g) => g.keys) })));
        }
      }
    }
    const answers = await Promise.all(calls);
    const found = new Map<string, string>();
    for (const a of answers) a.names.forEach((k, i) => found.set(k, a.states[i]));
    return { found, seq: Math.max(0, ...answers.map((a) => a.seq)),
             transit: answers.flatMap((a) => a.transit) };
  }

  /** Counts of this client's touches: accepted, absorbed into a buffered key, keys
   * written, keys buffered now. */
  stats(): { touches: number; absorbed: number; written: number; buffered: number } {
    const w = this.running("stats()");
    return { touches: w.touches, absorbed: w.absorbed, written: w.written, buffered: w.size };
  }

  /** Flush, then disconnect. Rejects with UnwrittenTouchesError (naming the keys) when
   * some accepted touch could not be written. */
  async close(): Promise<void> {
    if (this.closed || this.writer === null) {
      this.closed = true;
      return;
    }
    const writer = this.writer;
    let failure: Error | null = null;
    try {
      await writer.flush();
    } catch (e) {
      failure = e as Error;
    }
    this.closed = true;
    writer.stop();
    this.quota?.stop();
    await writer.settle();
    const left = writer.unwrittenKeys();
    this.redis?.disconnect();
    if (left.length > 0) throw new UnwrittenTouchesError(left, failure?.message ?? "not written");
  }
}

/** A client on `url`: a Cluster when the server says it is one (INFO cluster). */
async function connect(url: string, extra: RedisOptions): Promise<Client> {
  const base: RedisOptions = { maxRetriesPerRequest: 1, enableAutoPipelining: true, ...extra };
  const probe = new Redis(url, { ...base, lazyConnect: true, enableAutoPipelining: false });
  let info: string;
  try {
    await probe.connect();
    info = await probe.info("cluster");
  } catch (e) {
    probe.disconnect();
    throw e;
  }
  const { host, port, password, username, tls } = probe.options;
  probe.disconnect();
  if (!/^cluster_enabled:1/m.test(info)) {
    const redis = new Redis(url, base);
    redis.on("error", () => undefined); // each command's own error says what failed
    return redis;
  }
  const cluster = new Cluster([{ host, port }], {
    enableAutoPipelining: true,
    redisOptions: { password, username, tls, maxRetriesPerRequest: 1, ...extra },
  });
  await new Promise<void>((resolve, reject) => {
    cluster.once("ready", () => resolve());
    cluster.once("error", (e: Error) => reject(e));
  });
  cluster.on("error", () => undefined);
  return cluster;
}

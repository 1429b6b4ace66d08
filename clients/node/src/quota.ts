/**
 * The rules file's `limits:` at work, as coalescer/write/quota.py does it: every second
 * while this client takes touches (and a few counts after), else every minute, limits.lua
 * counts every shard's pending keys (and trims its dead letters, as every writer does),
 * and pending_bytes.lua reads on through its bytes; once the sum reaches
 * `limits.pending_keys` or `limits.pending_bytes`, touches are refused with
 * QuotaExceededError until a count finds less.
 */
import { QuotaExceededError } from "./errors.js";
import type { KeySpace } from "./keys.js";
import type { Config } from "./rules.js";
import type { Scripts } from "./scripts.js";

const EVERY = 1000;
const IDLE_EVERY = 60_000;
const AFTER_TOUCHES = 3;
const DROP_BUDGET = 1000;
const PAGE = 500;

export class Quota {
  pending: number | null = null;
  bytes: number | null = null;
  private seen = 0;
  private more = 0;
  private idleFor = 0;
  private timer: NodeJS.Timeout | null = null;

  constructor(private readonly config: Config, private readonly scripts: Scripts,
              private readonly keyspace: () => KeySpace, private readonly activity: () => number,
              private readonly log: (m: string) => void) {}

  /** Throws QuotaExceededError when the last count reached a limit. */
  check(): void {
    const l = this.config.limits;
    if (this.pending !== null && this.pending >= l.pendingKeys) {
      throw new QuotaExceededError(`touch refused: ${this.pending} keys are waiting for their ` +
        `refresh, at or over limits.pending_keys (${l.pendingKeys}); nothing was touched, try ` +
        `again in 1 s`, "pending_keys", l.pendingKeys, 1);
    }
    if (this.bytes !== null && this.bytes >= l.pendingBytes) {
      throw new QuotaExceededError(`touch refused: the keys waiting for their refresh hold ` +
        `${this.bytes} bytes of Redis (names, items, schedules, trace contexts), at or over ` +
        `limits.pending_bytes (${l.pendingBytes}); nothing was touched, try again in 1 s`,
        "pending_bytes", l.pendingBytes, 1);
    }
  }

  private refusing(): boolean {
    const l = this.config.limits;
    return (this.pending !== null && this.pending >= l.pendingKeys) ||
      (this.bytes !== null && this.bytes >= l.pendingBytes);
  }

  start(): void {
    const tick = async () => {
      try {
        await this.maybeStep();
      } catch (e) {
        this.log(`limits: counting pending keys failed: ${(e as Error).message}`);
      }
      if (this.timer !== null) this.schedule(tick);
    };
    this.schedule(tick);
  }

  private schedule(tick: () => Promise<void>): void {
    this.timer = setTimeout(() => void tick(), EVERY);
    this.timer.unref();
  }

  stop(): void {
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
  }

  private async maybeStep(): Promise<void> {
    const activity = this.activity();
    if (activity !== this.seen) {
      this.seen = activity;
      this.more = AFTER_TOUCHES;
    }
    const refusing = this.refusing();
    if (!(this.more || refusing || this.idleFor >= IDLE_EVERY)) {
      this.idleFor += EVERY;
      return;
    }
    const countBytes = this.more > 0 || refusing;
    this.more = Math.max(0, this.more - 1);
    this.idleFor = 0;
    await this.step(countBytes);
  }

  /** Count every shard's pending keys (and bytes), trim its dead letters. */
  async step(countBytes = true): Promise<void> {
    const space = this.keyspace();
    const rules = this.config.rules.map((r) => r.name);
    const l = this.config.limits;
    const keep = Math.ceil(l.deadLetters / space.shards);
    const answers = await Promise.all(space.allShards().map((s) =>
      this.scripts.limits(s, rules, keep, Math.round(l.deadLetterTtl * 1000), DROP_BUDGET)));
    this.pending = answers.reduce((n, a) => n + a.pending, 0);
    if (countBytes) {
      const items = this.config.rules.some((r) => r.itemsMax !== null);
      const found = await Promise.all(space.allShards().map((s) => this.scripts.pendingBytes(s, items, PAGE)));
      this.bytes = found.reduce((n, [b]) => n + b, 0);
    }
  }
}

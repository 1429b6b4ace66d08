/**
 * The part of a rules file a writer needs (namespace, shards, history, durability,
 * limits, and each rule's name, match, window, max_wait, absorb and items), read from
 * YAML with js-yaml and checked as coalescer/config/schema.py checks it. The fields
 * only a worker node uses (handler, timeout, retry, batch, rate, sources, ...) are
 * accepted and left alone; an unknown field is refused, naming it.
 */
import { readFileSync } from "node:fs";
import yaml from "js-yaml";
import { ConfigError, UnknownKeyError } from "./errors.js";
import { parseDuration } from "./durations.js";
import { KeyPattern } from "./pattern.js";

export interface Rule {
  readonly name: string;
  readonly match: string;
  readonly pattern: KeyPattern;
  /** seconds */
  readonly window: number;
  /** seconds */
  readonly maxWait: number;
  /** seconds */
  readonly absorb: number;
  /** distinct items a refresh gets at most; null: the rule takes no items */
  readonly itemsMax: number | null;
  /** `edge: leading`: the first touch of a quiet key is due at once */
  readonly leading: boolean;
}

export interface Limits {
  readonly pendingKeys: number;
  readonly pendingBytes: number;
  /** seconds */
  readonly maxScheduleAhead: number;
  readonly deadLetters: number;
  /** seconds */
  readonly deadLetterTtl: number;
}

export interface Config {
  readonly file: string;
  readonly namespace: string;
  readonly shards: number;
  readonly history: number;
  readonly replicas: number;
  /** seconds */
  readonly replicaTimeout: number;
  readonly limits: Limits;
  readonly rules: readonly Rule[];
}

const TOP_FIELDS = ["namespace", "shards", "leader_lease", "claim_lease", "history",
  "durability", "limits", "defaults", "rules", "sources"];
const SETTING_FIELDS = ["window", "max_wait", "absorb", "timeout", "concurrency", "retry",
  "edge"];
const RULE_FIELDS = ["name", "match", "handler", "rate", ...SETTING_FIELDS, "batch", "items",
  "isolation", "fair", "priority"];
const LIMIT_FIELDS = ["pending_keys", "pending_bytes", "max_schedule_ahead", "dead_letters",
  "dead_letter_ttl"];
export const NAME_RE = /^[A-Za-z0-9_.-]+$/;
export const ENV_NAMESPACE = "COALESCER_NAMESPACE";
const MAX_SHARDS = 16384;
const MAX_ITEMS = 100_000;
const MAX_COUNT = 1_000_000_000;
const MAX_BYTES = 2 ** 50;
const MAX_SCHEDULE_AHEAD = 10 * 365 * 86_400;
const DEFAULTS: Times = { window: 2, max_wait: 30, absorb: 0.05, edge: "trailing" };
export const DEFAULT_LIMITS: Limits = {
  pendingKeys: 1_000_000, pendingBytes: 2 ** 30, maxScheduleAhead: 400 * 86_400,
  deadLetters: 10_000, deadLetterTtl: 7 * 86_400,
};
const SIZE_UNITS: Record<string, number> = { "": 1, B: 1, kB: 1000, KB: 1000, KiB: 1024,
  MB: 1000 ** 2, MiB: 1024 ** 2, GB: 1000 ** 3, GiB: 1024 ** 3, TB: 1000 ** 4, TiB: 1024 ** 4 };

type Obj = Record<string, unknown>;

class Reader {
  constructor(readonly file: string) {}

  fail(field: string | null, message: string): never {
    throw new ConfigError(message, this.file, null, field);
  }

  mapping(value: unknown, field: string | null, allowed: string[], what: string): Obj {
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      this.fail(field, `${what} must be a mapping, got ${kind(value)}`);
    }
    for (const name of Object.keys(value as Obj)) {
      if (!allowed.includes(name)) {
        this.fail(join(field, name), `unknown field ${JSON.stringify(name)} in ${what}; ` +
          `known fields: ${allowed.join(", ")}`);
      }
    }
    return value as Obj;
  }

  duration(value: unknown, field: string, positive: boolean): number {
    let seconds: number;
    try {
      seconds = parseDuration(value);
    } catch (e) {
      this.fail(field, (e as Error).message);
    }
    if (positive && seconds <= 0) this.fail(field, `must be above 0, got ${JSON.stringify(value)}`);
    return seconds;
  }

  count(value: unknown, field: string, most: number): number {
    if (typeof value !== "number" || !Number.isInteger(value) || value < 1 || value > most) {
      this.fail(field, `must be a whole number from 1 to ${most}, got ${JSON.stringify(value)}`);
    }
    return value;
  }

  size(value: unknown, field: string): number {
    let size: number | null = null;
    if (typeof value === "number" && Number.isInteger(value) && value >= 0) size = value;
    if (typeof value === "string" && value.length <= 32) {
      const m = /^(\d+)\s*([A-Za-z]*)$/.exec(value.trim());
      if (m && m[2] in SIZE_UNITS) size = Number(m[1]) * SIZE_UNITS[m[2]];
    }
    if (size === null) {
      this.fail(field, `bad size ${JSON.stringify(value)}: expected a whole number of bytes, ` +
        'or a string with a unit: "64MiB", "1GiB", "500MB"');
    }
    if (size < 1 || size > MAX_BYTES) this.fail(field, `must be from 1 byte to 1PiB, got ${JSON.stringify(value)}`);
    return size;
  }
}

function join(prefix: string | null, name: string): string {
  return prefix ? `${prefix}.${name}` : name;
}

function kind(value: unknown): string {
  if (value === null || value === undefined) return "nothing";
  if (Array.isArray(value)) return "a list";
  if (typeof value === "object") return "a mapping";
  return `${typeof value} ${JSON.stringify(value)}`;
}

/** Read and check the rules file at `path`. `$COALESCER_NAMESPACE` replaces its namespace. */
export function loadRules(path: string, env: NodeJS.ProcessEnv = process.env): Config {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (e) {
    throw new ConfigError(`cannot read the rules file: ${(e as Error).message}`, path);
  }
  return parseRules(text, path, env);
}

/** Check the rules of YAML `text` (`file` names it in errors). */
export function parseRules(text: string, file = "<rules>",
                           env: NodeJS.ProcessEnv = process.env): Config {
  const r = new Reader(file);
  let doc: unknown;
  try {
    doc = yaml.load(text, { filename: file, schema: yaml.CORE_SCHEMA });
  } catch (e) {
    const err = e as { reason?: string; mark?: { line: number } };
    throw new ConfigError(`not valid YAML: ${err.reason ?? String(e)}`, file,
      err.mark ? err.mark.line + 1 : null);
  }
  const top = r.mapping(doc, null, TOP_FIELDS, "the rules file");
  let namespace = top.namespace === undefined ? "coalescer" : top.namespace;
  if (typeof namespace !== "string" || !NAME_RE.test(namespace)) {
    r.fail("namespace", `must use only letters, digits, '_', '.' and '-', got ${JSON.stringify(namespace)}`);
  }
  const override = env[ENV_NAMESPACE];
  if (override) {
    if (!NAME_RE.test(override)) {
      r.fail("namespace", `$${ENV_NAMESPACE} is ${JSON.stringify(override)}, which is not a ` +
        `namespace: it may only use letters, digits, '_', '.' and '-'; fix or unset $${ENV_NAMESPACE}`);
    }
    namespace = override;
  }
  const shards = top.shards === undefined ? 1 : r.count(top.shards, "shards", MAX_SHARDS);
  const history = top.history === undefined ? 1000 : historyOf(r, top.history);
  const durability = top.durability === undefined || top.durability === null ? {} :
    r.mapping(top.durability, "durability", ["replicas", "timeout"], "durability");
  const replicas = durability.replicas === undefined ? 0 : durability.replicas;
  if (typeof replicas !== "number" || !Number.isInteger(replicas) || replicas < 0 || replicas > 16) {
    r.fail("durability.replicas", `must be a whole number from 0 to 16, got ${JSON.stringify(replicas)}`);
  }
  const replicaTimeout = durability.timeout === undefined ? 1 :
    r.duration(durability.timeout, "durability.timeout", true);
  const limits = limitsOf(r, top.limits);
  const defaults = top.defaults === undefined || top.defaults === null ? {} :
    r.mapping(top.defaults, "defaults", SETTING_FIELDS, "defaults");
  const base = settings(r, defaults, "defaults", { ...DEFAULTS });
  const list = top.rules as unknown[];
  if (!Array.isArray(top.rules)) r.fail("rules", `rules must be a list of rules, got ${kind(top.rules)}`);
  if (list.length === 0) {
    r.fail("rules", 'rules is empty; give at least one rule (match: "*" accepts every key)');
  }
  const seen = new Set<string>();
  const rules = list.map((raw: unknown, i: number) => ruleOf(r, raw, i, base, seen));
  return { file, namespace: namespace as string, shards, history, replicas: replicas as number,
           replicaTimeout, limits, rules };
}

function historyOf(r: Reader, value: unknown): number {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 0 || value > 1_000_000) {
    r.fail("history", `must be a whole number from 0 to 1000000, got ${JSON.stringify(value)}`);
  }
  return value;
}

function limitsOf(r: Reader, value: unknown): Limits {
  if (value === undefined || value === null) return DEFAULT_LIMITS;
  const l = r.mapping(value, "limits", LIMIT_FIELDS, "limits");
  const ahead = l.max_schedule_ahead === undefined ? DEFAULT_LIMITS.maxScheduleAhead :
    r.duration(l.max_schedule_ahead, "limits.max_schedule_ahead", true);
  if (ahead > MAX_SCHEDULE_AHEAD) {
    r.fail("limits.max_schedule_ahead", `must be at most 3650d (10 years), got ${JSON.stringify(l.max_schedule_ahead)}`);
  }
  return {
    deadLetters: l.dead_letters === undefined ? DEFAULT_LIMITS.deadLetters :
      r.count(l.dead_letters, "limits.dead_letters", MAX_COUNT),
    deadLetterTtl: l.dead_letter_ttl === undefined ? DEFAULT_LIMITS.deadLetterTtl :
      r.duration(l.dead_letter_ttl, "limits.dead_letter_ttl", true),
    pendingKeys: l.pending_keys === undefined ? DEFAULT_LIMITS.pendingKeys :
      r.count(l.pending_keys, "limits.pending_keys", MAX_COUNT),
    pendingBytes: l.pending_bytes === undefined ? DEFAULT_LIMITS.pendingBytes :
      r.size(l.pending_bytes, "limits.pending_bytes"),
    maxScheduleAhead: ahead,
  };
}

type Times = { window: number; max_wait: number; absorb: number; edge: string };

function settings(r: Reader, given: Obj, prefix: string, base: Times): Times {
  const out = { ...base };
  if (given.window !== undefined) out.window = r.duration(given.window, `${prefix}.window`, true);
  if (given.max_wait !== undefined) out.max_wait = r.duration(given.max_wait, `${prefix}.max_wait`, true);
  if (given.absorb !== undefined) out.absorb = r.duration(given.absorb, `${prefix}.absorb`, false);
  if (given.edge !== undefined) {
    if (given.edge !== "trailing" && given.edge !== "leading") {
      r.fail(`${prefix}.edge`, `edge must be trailing or leading, got ${JSON.stringify(given.edge)}`);
    }
    out.edge = given.edge;
  }
  return out;
}

function ruleOf(r: Reader, raw: unknown, index: number, base: Times, seen: Set<string>): Rule {
  const prefix = `rules[${index}]`;
  const entries = r.mapping(raw, prefix, RULE_FIELDS, "a rule");
  const name = entries.name;
  if (typeof name !== "string" || !NAME_RE.test(name)) {
    r.fail(`${prefix}.name`, `a rule needs a name of letters, digits, '_', '.' and '-', got ${JSON.stringify(name)}`);
  }
  if (seen.has(name)) r.fail(`${prefix}.name`, `duplicate rule name ${JSON.stringify(name)}`);
  seen.add(name);
  let pattern: KeyPattern;
  try {
    pattern = KeyPattern.compile(entries.match);
  } catch (e) {
    r.fail(`${prefix}.match`, (e as Error).message);
  }
  const t = settings(r, entries, prefix, base);
  if (t.absorb >= t.window) {
    r.fail(`${prefix}.absorb`, `absorb (${t.absorb}s) must be shorter than window (${t.window}s); ` +
      "lengthen window or shorten absorb");
  }
  if (t.max_wait < t.window) {
    r.fail(`${prefix}.max_wait`, `max_wait (${t.max_wait}s) must be at least window ` +
      `(${t.window}s); raise max_wait or shorten window`);
  }
  let itemsMax: number | null = null;
  if (entries.items !== undefined && entries.items !== null) {
    const items = r.mapping(entries.items, `${prefix}.items`, ["max"], "items");
    if (items.max === undefined) r.fail(`${prefix}.items.max`, "items needs max: the most distinct items a refresh gets");
    itemsMax = r.count(items.max, `${prefix}.items.max`, MAX_ITEMS);
  }
  return { name, match: pattern.source, pattern, window: t.window, maxWait: t.max_wait,
           absorb: t.absorb, itemsMax, leading: t.edge === "leading" };
}

/** The rule of `key`: the first whose pattern matches, as the Python writer picks it. */
export function ruleFor(config: Config, key: string): Rule {
  for (const rule of config.rules) {
    if (key.startsWith(rule.pattern.prefix) && rule.pattern.matches(key)) return rule;
  }
  throw new UnknownKeyError(key, config.file);
}

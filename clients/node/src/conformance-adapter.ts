/**
 * The Node client's conformance adapter (conformance/README.md): one JSON request a line
 * on stdin, one answer a line on stdout, in order.
 *
 *   node clients/node/dist/conformance-adapter.js
 */
import { createInterface } from "node:readline";
import { Coalescer } from "./client.js";
import {
  BackpressureError, ClosedError, EvictionPolicyError, InvalidItemError, InvalidKeyError,
  InvalidScheduleError, ProtocolVersionError, QuotaExceededError, RedisRefusesWritesError,
  UnknownKeyError,
} from "./errors.js";
import { parseRules } from "./rules.js";

const CLIENT = "coalescer-node";
const DEFAULT_FLUSH_MS = 10_000;

class BadRequest extends Error {}
class FlushTimeout extends Error {}

type Req = Record<string, unknown>;
type Answer = Record<string, unknown>;

const CODES: [new (...a: never[]) => Error, string][] = [
  [QuotaExceededError, "QUOTA"],
  [BackpressureError, "BACKPRESSURE"],
  [EvictionPolicyError, "EVICTION_POLICY"],
  [ProtocolVersionError, "VERSION"],
  [UnknownKeyError, "UNKNOWN_KEY"],
  [InvalidKeyError, "BAD_INPUT"],
  [InvalidItemError, "BAD_INPUT"],
  [InvalidScheduleError, "BAD_INPUT"],
  [BadRequest, "BAD_INPUT"],
  [ClosedError, "CLOSED"],
  [FlushTimeout, "TIMEOUT"],
];

export function errorCode(e: unknown): string {
  if (e instanceof RedisRefusesWritesError) return e.replyCode;
  for (const [kind, code] of CODES) if (e instanceof kind) return code;
  return "INTERNAL";
}

function keysOf(req: Req): string[] {
  const keys = req.keys ?? [];
  if (!Array.isArray(keys) || !keys.every((k) => typeof k === "string")) {
    throw new BadRequest(`keys must be a list of strings, not ${JSON.stringify(keys)}`);
  }
  return keys as string[];
}

function timeOf(req: Req): { at?: number | string; delay?: number | string } {
  const out: { at?: number | string; delay?: number | string } = {};
  for (const name of ["at", "delay"] as const) {
    const v = req[name];
    if (v === undefined || v === null) continue;
    if (typeof v === "number" && Number.isInteger(v)) out[name] = v / 1000;
    else if (typeof v === "string") out[name] = v;
    else throw new BadRequest(`${name} must be an integer of ms or text, not ${JSON.stringify(v)}`);
  }
  return out;
}

class Adapter {
  client: Coalescer | null = null;

  private open_(): Coalescer {
    if (this.client === null) throw new ClosedError("no open: send open first");
    return this.client;
  }

  async handle(req: Req): Promise<Answer | null> {
    switch (req.op) {
      case "hello": return { client: CLIENT, protocol: 1 };
      case "open": return this.open(req);
      case "touch": return this.touch(req);
      case "flush": return this.flush(req);
      case "cancel": {
        const outcome = await this.open_().cancelMany(keysOf(req));
        return { cancelled: outcome.cancelled.length, states: outcome.states };
      }
      case "close": {
        const client = this.open_();
        this.client = null;
        await client.close();
        return {};
      }
      default: return null;
    }
  }

  async open(req: Req): Promise<Answer> {
    const config = parseRules(String(req.rules), "<open rules>", {});
    if (req.namespace !== undefined && config.namespace !== req.namespace) {
      throw new BadRequest(`the rules name namespace ${JSON.stringify(config.namespace)}, ` +
        `the request ${JSON.stringify(req.namespace)}`);
    }
    const client = new Coalescer({ config, redisUrl: String(req.url), logger: (level, m) => {
      process.stderr.write(`${level}: ${m}\n`);
    } });
    await client.start();
    this.client = client;
    return {};
  }

  touch(req: Req): Answer {
    const client = this.open_();
    const keys = keysOf(req);
    const items = req.items ?? {};
    if (items === null || typeof items !== "object" || Array.isArray(items)) {
      throw new BadRequest(`items must be an object of key -> [item, ...], not ${JSON.stringify(items)}`);
    }
    const pairs: [string, string][] = [];
    for (const [key, listed] of Object.entries(items as Record<string, unknown>)) {
      if (!Array.isArray(listed)) throw new BadRequest(`items of ${JSON.stringify(key)} must be a list`);
      for (const item of listed) pairs.push([key, String(item)]);
    }
    const options = { ...timeOf(req), keepItems: Boolean(req.keep_items ?? false) };
    if (options.at === undefined && options.delay === undefined) {
      if (options.keepItems) options.keepItems = false;
    }
    if (pairs.length > 0) client.touchItems(pairs, { ...options, keys });
    else client.touchMany(keys, options);
    return { touched: new Set([...keys, ...Object.keys(items)]).size };
  }

  async flush(req: Req): Promise<Answer> {
    const ms = Number(req.timeout_ms ?? DEFAULT_FLUSH_MS);
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new FlushTimeout(`flush did not finish within ${ms} ms`)), ms);
    });
    try {
      await Promise.race([this.open_().flush(), timeout]);
    } finally {
      clearTimeout(timer);
    }
    return {};
  }
}

async function answer(adapter: Adapter, line: string): Promise<Answer> {
  let req: unknown;
  try {
    req = JSON.parse(line);
  } catch (e) {
    return { id: null, ok: false, error: { code: "BAD_INPUT", message: (e as Error).message } };
  }
  const id = req !== null && typeof req === "object" ? (req as Req).id ?? null : null;
  try {
    if (req === null || typeof req !== "object" || Array.isArray(req)) {
      throw new BadRequest("a request is a JSON object");
    }
    const fields = await adapter.handle(req as Req);
    if (fields === null) {
      return { id, ok: false, error: { code: "UNSUPPORTED", message: `unknown op ${JSON.stringify((req as Req).op)}` } };
    }
    return { id, ok: true, ...fields };
  } catch (e) {
    return { id, ok: false, error: { code: errorCode(e), message: (e as Error).message || String(e) } };
  }
}

async function main(): Promise<void> {
  const adapter = new Adapter();
  const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const reply = await answer(adapter, line);
    process.stdout.write(`${JSON.stringify(reply)}\n`);
    if (reply.ok && (JSON.parse(line) as Req).op === "close") break;
  }
  lines.close();
  // stdin closed without close: nothing waits for buffered touches
  process.exit(0);
}

void main();

/**
 * What a failed write means for its keys (as coalescer/write/failures.py decides):
 * - "key": Redis refused something about one key (WRONGTYPE, a script error on the
 *   key's state): the write is split until that key is found, and it alone is dropped;
 * - "refused": an error reply about the server (MISCONF, READONLY, OOM, NOREPLICAS,
 *   NOPERM, BUSY, LOADING, MASTERDOWN, an unknown one): the touches stay buffered and
 *   are retried;
 * - "unreached": the connection failed or timed out, or a cluster redirection asks for
 *   another try: retried too.
 */
import {
  CoalescerError, RedisRefusesWritesError, RedisUnreachableError, RedisWriteError,
} from "./errors.js";

export type Fault = "key" | "refused" | "unreached";

const KEY_TEXTS = ["wrong kind of value", "value is not an integer", "value is not a valid float",
  "exceeds maximum allowed size"];
const SCRIPT_ERROR = /(?<!@)user_script:\d+:/;
const RETRY_CODES = new Set(["TRYAGAIN", "CLUSTERDOWN", "ASK", "MOVED"]);

function isReply(e: unknown): e is Error {
  return e instanceof Error && e.name === "ReplyError";
}

/** The code of an error reply ("MISCONF", ...; "UNKNOWN" without one), else null. */
export function replyCode(e: unknown): string | null {
  if (!isReply(e)) return null;
  const first = e.message.split(" ", 1)[0];
  return /^[A-Z]+$/.test(first) ? first : "UNKNOWN";
}

export function classify(e: unknown): Fault {
  if (e instanceof RedisWriteError) return e instanceof RedisRefusesWritesError ? "refused" : "unreached";
  const code = replyCode(e);
  if (code !== null) {
    if (RETRY_CODES.has(code)) return "unreached";
    if (code === "WRONGTYPE") return "key";
    if (code === "ERR" || code === "UNKNOWN") {
      const text = (e as Error).message;
      if (KEY_TEXTS.some((t) => text.includes(t)) || SCRIPT_ERROR.test(text)) return "key";
    }
    return "refused";
  }
  return "unreached";
}

/** The typed error flush() rejects with for a write that failed with `e`. */
export function writeError(e: unknown): Error {
  if (e instanceof CoalescerError) return e;
  const code = replyCode(e);
  if (code !== null) {
    const text = (e as Error).message.split(/\s+/).join(" ");
    return new RedisRefusesWritesError(code, text);
  }
  const detail = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  return new RedisUnreachableError(`Redis could not be reached: ${detail}`);
}

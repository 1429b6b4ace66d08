/**
 * Every error the client throws on purpose. Each has a stable `code` (its class name),
 * the same names as the Python package's errors (coalescer/errors.py).
 */

/** Base class of the client's own errors. */
export class CoalescerError extends Error {
  readonly code: string = "CoalescerError";
  constructor(message: string) {
    super(message);
    this.name = new.target.name;
    (this as { code: string }).code = new.target.name;
  }
}

/** A rules file that cannot be used, with the file, line and field at fault. */
export class ConfigError extends CoalescerError {
  constructor(message: string, readonly file: string = "<rules>",
              readonly line: number | null = null, readonly field: string | null = null) {
    super(`${line === null ? file : `${file}:${line}`}: ${field ? `${field}: ` : ""}${message}`);
  }
}

/** A touched key that was refused: nothing of that touch was applied. */
export class KeyRefusedError extends CoalescerError {
  constructor(message: string, readonly key: string) {
    super(message);
  }
}

/** A touched key that matches no rule. */
export class UnknownKeyError extends KeyRefusedError {
  constructor(key: string, rulesFile: string | null = null) {
    super(`no rule${rulesFile ? ` in ${rulesFile}` : ""} matches key ${shown(key)}`, key);
  }
}

/** A touched key that Redis cannot store (not UTF-8, a NUL character, too long). */
export class InvalidKeyError extends KeyRefusedError {
  constructor(key: string, readonly reason: string) {
    super(`key ${shown(key)} cannot be stored: ${reason}`, key);
  }
}

/** A touch's item that was refused (empty, too long, a NUL, a rule without items). */
export class InvalidItemError extends KeyRefusedError {
  constructor(key: string, readonly item: unknown, readonly reason: string) {
    super(`item ${shown(item)} of key ${shown(key)} cannot be touched: ${reason}`, key);
  }
}

/** A touch's time (`at` or `delay`) that was refused; nothing of the call was applied. */
export class InvalidScheduleError extends CoalescerError {
  constructor(readonly key: string, readonly value: unknown, readonly reason: string) {
    super(`time ${shown(value)} of the touch of key ${shown(key)} refused: ${reason}`);
  }
}

/** The in-process buffer is full: the touch was not accepted. */
export class BackpressureError extends CoalescerError {}

/** The keys waiting for their refresh reached `limits.pending_keys` (or their bytes
 * `limits.pending_bytes`): the touch was not accepted; try again after `retryAfter` s. */
export class QuotaExceededError extends BackpressureError {
  constructor(message: string, readonly limit: string, readonly value: number,
              readonly retryAfter: number) {
    super(message);
  }
}

/** `flush()` could not write every touch; the touches stay buffered and are retried. */
export class RedisWriteError extends CoalescerError {}

/** Redis could not be reached (refused connection, timeout, reset). */
export class RedisUnreachableError extends RedisWriteError {}

/** Redis answered the writes with an error reply that is about the server, not a key
 * (MISCONF, READONLY, OOM, NOREPLICAS, NOPERM, BUSY, LOADING, ...). */
export class RedisRefusesWritesError extends RedisWriteError {
  constructor(readonly replyCode: string, readonly reply: string) {
    super(`Redis refuses writes: ${reply}`);
  }
}

/** Fewer replicas than `durability.replicas` acknowledged a write in time. */
export class ReplicationError extends RedisWriteError {
  constructor(readonly acknowledged: number, readonly wanted: number) {
    super(`only ${acknowledged} of ${wanted} replicas acknowledged the write in time`);
  }
}

/** `close()` could not write every accepted touch: `keys` were not written. */
export class UnwrittenTouchesError extends CoalescerError {
  readonly count: number;
  constructor(readonly keys: string[], readonly reason: string) {
    const sorted = [...keys].sort();
    const more = sorted.length > 5 ? ` and ${sorted.length - 5} more` : "";
    super(`close(): ${sorted.length} touched keys were not written to Redis (${reason}): ` +
          `${sorted.slice(0, 5).map((k) => shown(k)).join(", ")}${more}`);
    this.count = sorted.length;
    this.keys = sorted;
  }
}

/** The server's `maxmemory-policy` may evict coalescer's keys: refused at start. */
export class EvictionPolicyError extends CoalescerError {}

/** The namespace's protocol version in Redis is one this client does not speak. */
export class ProtocolVersionError extends CoalescerError {
  constructor(readonly found: string, readonly supported: string, message: string) {
    super(message);
  }
}

/** touch() or flush() on a client that is closed or not started. */
export class ClosedError extends CoalescerError {}

/** A Lua script answered something the client does not understand. */
export class ScriptError extends CoalescerError {}

/** A value as the messages show it: JSON, cut short when long. */
export function shown(value: unknown, limit = 80): string {
  if (typeof value === "string" && value.length > limit) {
    return `${JSON.stringify(value.slice(0, limit))}... (${value.length} characters)`;
  }
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

/**
 * Which keys and items Redis can store (as coalescer/store/keycheck.py says): a key is
 * well-formed UTF-16 (so it encodes as UTF-8), holds no NUL and is at most 1024 bytes in
 * UTF-8; an item is a non-empty string of at most 256 bytes without NUL.
 */
import { InvalidItemError, InvalidKeyError } from "./errors.js";

export const MAX_KEY_BYTES = 1024;
export const MAX_ITEM_BYTES = 256;

function wellFormed(s: string): boolean {
  const f = (s as { isWellFormed?: () => boolean }).isWellFormed;
  if (f) return f.call(s);
  return !/[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/.test(s);
}

function problem(value: unknown, what: string, most: number): string | null {
  if (typeof value !== "string") return `${what} must be a string, not ${value === null ? "null" : typeof value}`;
  if (!wellFormed(value)) return "it holds a lone surrogate: it cannot be encoded as UTF-8";
  const nul = value.indexOf("\0");
  if (nul >= 0) return `it contains a NUL character (at index ${nul})`;
  // at most 3 UTF-8 bytes per UTF-16 code unit: short strings need no count
  if (value.length * 3 > most) {
    const size = Buffer.byteLength(value, "utf8");
    if (size > most) return `it is ${size} bytes long in UTF-8, over the limit of ${most}`;
  }
  return null;
}

/** Throws InvalidKeyError when Redis cannot store `key`. */
export function checkKey(key: unknown): asserts key is string {
  const p = problem(key, "a key", MAX_KEY_BYTES);
  if (p !== null) throw new InvalidKeyError(String(key), p);
}

/** Throws InvalidItemError when `item` cannot go with a touch of `key` (of a rule
 * named `rule`, which takes items or not). */
export function checkItem(key: string, item: unknown, rule: string, takesItems: boolean): void {
  let p = problem(item, "an item", MAX_ITEM_BYTES);
  if (p === null && item === "") p = "an item must not be empty";
  if (p === null && !takesItems) {
    p = `its rule ${JSON.stringify(rule)} takes no items (give the rule items: {max: N} ` +
      "to deliver them to its refreshes)";
  }
  if (p !== null) throw new InvalidItemError(key, item, p);
}

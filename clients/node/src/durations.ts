/**
 * Durations as a rules file writes them: a number of seconds, or a string with ms, s, m,
 * h or d ("50ms", "2s", "1.5m"), read as coalescer/config/durations.py reads them.
 */

const UNITS: Record<string, number> = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 };
const DURATION_RE = /^(-\s*)?(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?$/;
export const MAX_TEXT = 64;
export const ACCEPTED =
  'a number of seconds >= 0 (e.g. 2 or 0.25), or a string with a unit: ' +
  '"50ms", "2s", "1.5s", "5m", "2h", "1d"';

/** Seconds of `value`; throws RangeError naming the value and what is accepted. */
export function parseDuration(value: unknown): number {
  if (typeof value === "number") return checked(value, value);
  if (typeof value === "string") {
    if (value.length > MAX_TEXT) {
      throw new RangeError(`bad duration ${JSON.stringify(value.slice(0, 40))}... ` +
        `(${value.length} characters): longer than ${MAX_TEXT} characters; expected ${ACCEPTED}`);
    }
    const m = DURATION_RE.exec(value.trim());
    if (m) {
      const sign = m[1] ? -1 : 1;
      return checked(sign * Number(m[2]) * UNITS[m[3] ?? "s"], value);
    }
  }
  throw new RangeError(`bad duration ${JSON.stringify(value)}: expected ${ACCEPTED}`);
}

function checked(seconds: number, value: unknown): number {
  if (!Number.isFinite(seconds)) {
    throw new RangeError(`bad duration ${JSON.stringify(value)}: expected ${ACCEPTED}`);
  }
  if (seconds < 0) {
    throw new RangeError(`negative duration ${JSON.stringify(value)}: a duration is never ` +
      `below 0; expected ${ACCEPTED}`);
  }
  return seconds + 0;
}

/** Python's round(): halves go to the even neighbour (so both writers agree to the ms). */
export function roundHalfEven(x: number): number {
  const r = Math.round(x);
  if (Math.abs(x % 1) === 0.5 && r % 2 !== 0) return r - 1;
  return r;
}

/** Whole milliseconds of `seconds`, rounded as the Python writer rounds them. */
export function ms(seconds: number): number {
  return roundHalfEven(seconds * 1000);
}

/**
 * A touch's own time, as the upsert script takes it (coalescer/config/schedule.py):
 * `a<epoch ms>` for `at`, `d<ms>` for `delay` (Redis adds its own clock); `k` after it
 * keeps the key's items; `+` when a plain touch of the key followed before the write.
 */
import { InvalidScheduleError } from "./errors.js";
import { MAX_TEXT, parseDuration, roundHalfEven } from "./durations.js";

export type At = Date | number | string;
export type Delay = number | string;

const AT_FORMS = "a Date, epoch seconds (a number), or ISO-8601 text with an offset " +
  "(2026-12-05T12:00:00+00:00)";
const DELAY_FORMS = 'seconds >= 0 (a number) or a duration string ("30m", "1.5s", "2h")';
const ISO_OFFSET = /(Z|[+-]\d\d:?\d\d)$/i;

/** The wire form of a touch's time, or null for a plain touch. `ahead`: seconds. */
export function scheduleSpec(key: string, at: At | undefined, delay: Delay | undefined,
                             ahead: number, keepItems = false): string | null {
  if (at === undefined && delay === undefined) return null;
  if (at !== undefined && delay !== undefined) {
    throw new InvalidScheduleError(key, { at, delay }, "give at or delay, not both");
  }
  const spec = at !== undefined ? `a${atMs(key, at, ahead)}` : `d${delayMs(key, delay!, ahead)}`;
  return keepItems ? `${spec}k` : spec;
}

function aheadText(ahead: number): string {
  return `more than limits.max_schedule_ahead (${ahead} s) ahead of now; set a higher ` +
    "limits.max_schedule_ahead in the rules file to allow it";
}

/** Epoch ms of `at`, checked against the epoch and `ahead` seconds from now. */
export function atMs(key: string, at: unknown, ahead: number): number {
  const seconds = atSeconds(key, at);
  if (seconds < 0) {
    throw new InvalidScheduleError(key, at, "it is before the epoch (1970-01-01T00:00:00Z): " +
      "a time is at or after it");
  }
  if (seconds - Date.now() / 1000 > ahead) throw new InvalidScheduleError(key, at, aheadText(ahead));
  return roundHalfEven(seconds * 1000);
}

function atSeconds(key: string, at: unknown): number {
  if (at instanceof Date) {
    const t = at.getTime();
    if (!Number.isFinite(t)) throw new InvalidScheduleError(key, String(at), "an invalid Date");
    return t / 1000;
  }
  if (typeof at === "number") {
    if (!Number.isFinite(at) || at < 0) {
      throw new InvalidScheduleError(key, at, "epoch seconds must be a finite number >= 0");
    }
    return at;
  }
  if (typeof at === "string") {
    if (at.length > MAX_TEXT) {
      throw new InvalidScheduleError(key, at, `longer than ${MAX_TEXT} characters: expected ${AT_FORMS}`);
    }
    const text = at.trim();
    if (text !== "" && !Number.isNaN(Number(text)) && /^[-+.\d]/.test(text)) {
      return atSeconds(key, Number(text));
    }
    if (!/^\d{4}-\d\d-\d\d/.test(text)) {
      throw new InvalidScheduleError(key, at, `not a time: expected ${AT_FORMS}`);
    }
    if (!ISO_OFFSET.test(text)) {
      throw new InvalidScheduleError(key, at, "a naive time (no offset): give one, e.g. " +
        "2030-01-01T12:00:00+00:00");
    }
    const t = Date.parse(text);
    if (Number.isNaN(t)) throw new InvalidScheduleError(key, at, `not a time: expected ${AT_FORMS}`);
    return t / 1000;
  }
  throw new InvalidScheduleError(key, at, `not a time: expected ${AT_FORMS}`);
}

/** Milliseconds of `delay`, checked against `ahead` seconds. */
export function delayMs(key: string, delay: unknown, ahead: number): number {
  if (typeof delay === "string" && delay.length > MAX_TEXT) {
    throw new InvalidScheduleError(key, delay, `longer than ${MAX_TEXT} characters: expected ${DELAY_FORMS}`);
  }
  if ((typeof delay === "string" && delay.trim().startsWith("-")) ||
      (typeof delay === "number" && delay < 0)) {
    throw new InvalidScheduleError(key, delay, "a negative delay: a delay is >= 0");
  }
  let seconds: number;
  try {
    seconds = parseDuration(delay);
  } catch {
    throw new InvalidScheduleError(key, delay, `not a delay: expected ${DELAY_FORMS}`);
  }
  if (seconds > ahead) throw new InvalidScheduleError(key, delay, aheadText(ahead));
  return roundHalfEven(seconds * 1000);
}

/** `spec` followed by a plain touch of its key. */
export function thenPlain(spec: string): string {
  return spec.endsWith("+") ? spec : `${spec}+`;
}

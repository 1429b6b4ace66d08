export { Coalescer } from "./client.js";
export type { CancelOutcome, CoalescerOptions, Logger, TouchOptions } from "./client.js";
export * from "./errors.js";
export { loadRules, parseRules, ruleFor } from "./rules.js";
export type { Config, Limits, Rule } from "./rules.js";
export { KeyPattern } from "./pattern.js";
export { KeySpace, ShardKeys, keyHash } from "./keys.js";
export { VERSION as PROTOCOL_VERSION } from "./protocol.js";
export type { At, Delay } from "./schedule.js";

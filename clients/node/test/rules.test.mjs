// Rules, patterns, the shard function and touch times, checked against what the Python
// package answers for the same input (the vectors below were taken from it).
import assert from "node:assert/strict";
import { test } from "node:test";
import { ConfigError, KeyPattern, KeySpace, keyHash, parseRules, ruleFor, UnknownKeyError } from "../dist/index.js";
import { scheduleSpec } from "../dist/schedule.js";

test("the shard function is zlib's crc32 of the key's UTF-8, as the Python writer's", () => {
  const vectors = [["stats:user:42", 1709105668, 4], ["orders:ü:x", 227051361, 1],
    ["emoji:😀", 3204904160, 0], ["a", 3904355907, 3]];
  for (const [key, hash, shard] of vectors) {
    assert.equal(keyHash(key), hash, key);
    assert.equal(new KeySpace("ns", 16).shardOf(key), shard, key);
  }
});

test("patterns match as the Python matcher does", () => {
  const cases = [["stats:user:{id}", "stats:user:42", true], ["stats:user:{id}", "stats:user:4:2", false],
    ["orders:{shop}:*", "orders:a:b:c", true], ["a*b*c", "axxbyyc", true], ["a*b*c", "axxbyy", false],
    ["{x}x", "xx", true], ["{x}x", "x", false], ["*:{y}", "a:b:c", true], ["*:{y}", "a:b:", false],
    ["{a}{b}", "ab", true], ["{a}{b}", "a", false], ["x.y", "xzy", false], ["*", "a\0b", false]];
  for (const [pattern, key, want] of cases) {
    assert.equal(KeyPattern.compile(pattern).matches(key), want, `${pattern} ~ ${JSON.stringify(key)}`);
  }
});

test("a pattern with many wildcards matches a long key in linear work", () => {
  const p = KeyPattern.compile("*a*a*a*a*a*a*a*b");
  const key = "a".repeat(1000);
  assert.equal(p.matches(key), false); // a backtracking expression would not end
});

test("bad patterns are refused saying what is allowed", () => {
  for (const bad of ["", "a{", "{}", "{1x}", "{a}:{a}"]) {
    assert.throws(() => KeyPattern.compile(bad), /pattern|braces|capture/);
  }
});

const RULES = `
namespace: t
rules:
  - name: first
    match: "stats:{id}"
    handler: x:y
  - name: rest
    match: "stats:*"
    window: 5s
    max_wait: 1m
    absorb: 10ms
    items: {max: 7}
`;

test("rules: first match wins, settings and defaults are read", () => {
  const config = parseRules(RULES, "rules.yaml", {});
  assert.equal(ruleFor(config, "stats:1").name, "first");
  const rest = ruleFor(config, "stats:1:2");
  assert.deepEqual([rest.name, rest.window, rest.maxWait, rest.absorb, rest.itemsMax], ["rest", 5, 60, 0.01, 7]);
  const first = ruleFor(config, "stats:1");
  assert.deepEqual([first.window, first.maxWait, first.absorb, first.itemsMax], [2, 30, 0.05, null]);
  assert.throws(() => ruleFor(config, "other"), UnknownKeyError);
});

test("rules: $COALESCER_NAMESPACE replaces the namespace", () => {
  assert.equal(parseRules(RULES, "r", { COALESCER_NAMESPACE: "mine" }).namespace, "mine");
  assert.throws(() => parseRules(RULES, "r", { COALESCER_NAMESPACE: "a b" }), /COALESCER_NAMESPACE/);
});

test("rules: bad files are refused naming the file and field", () => {
  const bad = [
    ["rules: []", /rules is empty/],
    ["rules:\n  - {name: a, match: 'x', window: 1s, absorb: 2s}", /rules\[0\]\.absorb: absorb/],
    ["rules:\n  - {name: a, match: 'x', window: 10s, max_wait: 1s}", /rules\[0\]\.max_wait/],
    ["rules:\n  - {name: a, match: 'x', windw: 1s}", /rules\[0\]\.windw: unknown field/],
    ["rules:\n  - {name: a, match: 'x'}\n  - {name: a, match: 'y'}", /duplicate rule name/],
    ["rules:\n  - {name: a, match: 'x', window: fast}", /bad duration/],
    ["rules:\n  - {name: a, match: 'x', items: {}}", /items\.max/],
    ["colour: red\nrules: []", /unknown field "colour"/],
    ["rules: [", /not valid YAML/],
  ];
  for (const [text, message] of bad) {
    assert.throws(() => parseRules(text, "bad.yaml", {}), (e) => e instanceof ConfigError &&
      e.message.startsWith("bad.yaml") && message.test(e.message), text);
  }
});

test("times take the wire form of the Python writer", () => {
  assert.equal(scheduleSpec("k", 1_800_000_000, undefined, 1e12), "a1800000000000");
  assert.equal(scheduleSpec("k", "2027-01-01T00:00:00Z", undefined, 1e12), "a1798761600000");
  assert.equal(scheduleSpec("k", new Date(1_800_000_000_123), undefined, 1e12), "a1800000000123");
  assert.equal(scheduleSpec("k", undefined, "1.5s", 1e12), "d1500");
  assert.equal(scheduleSpec("k", undefined, 30, 1e12, true), "d30000k");
  assert.equal(scheduleSpec("k", undefined, undefined, 1e12), null);
  for (const [at, delay] of [[1, 2], ["2027-01-01T00:00:00", undefined], [-1, undefined],
    [undefined, "-2s"], [undefined, "soon"], [undefined, 86_400 * 500]]) {
    assert.throws(() => scheduleSpec("k", at, delay, 400 * 86_400), { name: "InvalidScheduleError" });
  }
});

// The client against a real valkey-server the tests start (see servers.mjs): what Redis
// holds after a touch, as a Python node reads it.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import {
  BackpressureError, ClosedError, Coalescer, EvictionPolicyError, InvalidItemError,
  InvalidKeyError, InvalidScheduleError, KeySpace, ProtocolVersionError, QuotaExceededError,
  RedisRefusesWritesError, RedisUnreachableError, UnknownKeyError, UnwrittenTouchesError,
} from "../dist/index.js";
import { rulesFile, startServer } from "./servers.mjs";

let server;
let n = 0;
before(async () => { server = await startServer(); });
after(async () => { await server.stop(); });

const quiet = () => undefined;

function rules(extra = "") {
  n += 1;
  return `namespace: t${n}
${extra}
rules:
  - name: user-stats
    match: "stats:user:{user_id}"
    window: 1s
    handler: app:refresh
  - name: orders
    match: "orders:{shop}:*"
    window: 5s
    max_wait: 1m
    items: {max: 3}
    handler: app:orders
`;
}

async function client(extra = "", options = {}) {
  return Coalescer.connect({ rulesYaml: rules(extra), redisUrl: server.url, logger: quiet, ...options });
}

const shard0 = (c) => new KeySpace(c.config.namespace, 1).shard(0);
async function serverMs() {
  const [s, us] = await server.redis.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

async function pollUntil(check, ms = 10_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const got = await check();
    if (got) return got;
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 20));
  }
}

test("a touch is in Redis once flush resolves, due a window after the server took it", async () => {
  const c = await client();
  const before = await serverMs();
  c.touch("stats:user:42");
  await c.flush();
  const after = await serverMs();
  const s = shard0(c);
  const due = Number(await server.redis.zscore(s.due("user-stats"), "stats:user:42"));
  assert.ok(due >= before + 1000 && due <= after + 1000, `due ${due} in [${before}, ${after}] + 1 s`);
  assert.ok(await server.redis.hget(s.meta, "stats:user:42"));
  await c.close();
});

test("touch is absorbed in process: a hot key costs one write", async () => {
  const c = await client();
  for (let i = 0; i < 10_000; i++) c.touch("stats:user:hot");
  await c.flush();
  const stats = c.stats();
  assert.equal(stats.touches, 10_000);
  assert.equal(stats.written, 1);
  assert.equal(stats.absorbed, 9_999);
  await c.close();
});

test("touchMany spreads keys over the shards by crc32, every key once", async () => {
  const c = await client("shards: 4");
  const keys = Array.from({ length: 500 }, (_, i) => `stats:user:${i}`);
  c.touchMany(keys);
  await c.flush();
  const space = new KeySpace(c.config.namespace, 4);
  for (let shard = 0; shard < 4; shard++) {
    const held = (await server.redis.zrange(space.shard(shard).due("user-stats"), 0, -1)).sort();
    const want = keys.filter((k) => space.shardOf(k) === shard).sort();
    assert.deepEqual(held, want);
  }
  await c.close();
});

test("items go with their key, past the rule's max an overflow mark", async () => {
  const c = await client();
  c.touchItems([["orders:a:1", "r1"], ["orders:a:1", "r2"]]);
  c.touch("orders:a:1", "r3");
  c.touch("orders:a:1", "r4");
  await c.flush();
  const items = await server.redis.smembers(shard0(c).itemsPrefix + "orders:a:1");
  assert.deepEqual(items.sort(), ["", "r1", "r2", "r3"]);
  assert.throws(() => c.touch("stats:user:1", "x"), InvalidItemError);
  assert.throws(() => c.touch("orders:a:1", ""), InvalidItemError);
  await c.close();
});

test("at and delay set the due time; bad times touch nothing", async () => {
  const c = await client();
  const at = Date.now() + 3_600_000;
  c.touch("stats:user:at", null, { at: new Date(at) });
  const before = await serverMs();
  c.touchMany(["stats:user:d"], { delay: "10m" });
  await c.flush();
  const after = await serverMs();
  const s = shard0(c);
  assert.equal(Number(await server.redis.zscore(s.due("user-stats"), "stats:user:at")), at);
  const due = Number(await server.redis.zscore(s.due("user-stats"), "stats:user:d"));
  assert.ok(due >= before + 600_000 && due <= after + 600_000);
  assert.throws(() => c.touch("stats:user:x", null, { at: 1, delay: 1 }), InvalidScheduleError);
  assert.throws(() => c.touchMany(["stats:user:y", "stats:user:z"], { delay: "500d" }), InvalidScheduleError);
  assert.equal(c.stats().buffered, 0);
  await c.close();
});

test("refused keys touch nothing: unknown, a NUL, too long, a lone surrogate", async () => {
  const c = await client();
  assert.throws(() => c.touch("nope"), UnknownKeyError);
  assert.throws(() => c.touchMany(["stats:user:1", "nope"]), UnknownKeyError);
  assert.throws(() => c.touch("stats:user:a\0b"), InvalidKeyError);
  assert.throws(() => c.touch(`stats:user:${"é".repeat(600)}`), /over the limit of 1024/);
  assert.throws(() => c.touch("stats:user:\uD800"), InvalidKeyError);
  assert.equal(c.stats().buffered, 0);
  await c.close();
});

test("cancel drops pending refreshes and buffered touches, and says what it found", async () => {
  const c = await client();
  c.touchMany(["stats:user:1", "stats:user:2"]);
  await c.flush();
  c.touch("stats:user:3");
  const outcome = await c.cancelMany(["stats:user:1", "stats:user:3", "stats:user:4"]);
  assert.deepEqual(outcome.states, { "stats:user:1": "pending", "stats:user:3": "buffered",
    "stats:user:4": "idle" });
  assert.deepEqual(outcome.cancelled, ["stats:user:1", "stats:user:3"]);
  await c.flush();
  const s = shard0(c);
  assert.deepEqual(await server.redis.zrange(s.due("user-stats"), 0, -1), ["stats:user:2"]);
  await assert.rejects(c.cancel("nope"), UnknownKeyError);
  await c.close();
});

test("a full buffer refuses a new key with BackpressureError", async () => {
  const c = await client("", { maxBuffered: 2 });
  c.touch("stats:user:1");
  c.touch("stats:user:2");
  c.touch("stats:user:1");
  assert.throws(() => c.touch("stats:user:3"), BackpressureError);
  await c.flush();
  c.touch("stats:user:3");
  await c.close();
});

test("an evicting maxmemory-policy is refused at start, naming it and the fix", async () => {
  await server.redis.config("SET", "maxmemory-policy", "allkeys-lru");
  try {
    await assert.rejects(client(), (e) => e instanceof EvictionPolicyError &&
      /allkeys-lru/.test(e.message) && /noeviction/.test(e.message));
  } finally {
    await server.redis.config("SET", "maxmemory-policy", "noeviction");
  }
});

test("the protocol version is written once and another major is refused, naming both", async () => {
  const c = await client();
  const key = `${c.config.namespace}:{${c.config.namespace}:nodes}:protocol`;
  assert.equal(await server.redis.get(key), "1.0");
  await c.close();
  await server.redis.set(`t${n + 1}:{t${n + 1}:nodes}:protocol`, "2.3");
  await assert.rejects(client(), (e) => e instanceof ProtocolVersionError &&
    /version 2\.3/.test(e.message) && /speaks version 1\.0/.test(e.message));
  await server.redis.set(`t${n + 1}:{t${n + 1}:nodes}:protocol`, "1.7");
  const later = await client();
  assert.equal(later.protocolVersion, "1.7");
  await later.close();
});

test("an unreadable stored protocol version is refused, naming it, and nothing is written", async () => {
  const ns = `t${n + 1}`;
  const key = `${ns}:{${ns}:nodes}:protocol`;
  await server.redis.set(key, "v1");
  await assert.rejects(client(), (e) => e instanceof ProtocolVersionError && e.found === "v1" &&
    /an unreadable version "v1"/.test(e.message) && /speaks version 1\.0/.test(e.message) &&
    e.message.includes(key));
  assert.equal(await server.redis.get(key), "v1");
  assert.deepEqual(await server.redis.keys(`${ns}:*`), [key]);
});

test("an error reply keeps the touches buffered; they are written once Redis takes them", async () => {
  const c = await client();
  await server.redis.config("SET", "min-replicas-to-write", "1");
  try {
    c.touch("stats:user:r");
    await assert.rejects(c.flush(), (e) => e instanceof RedisRefusesWritesError &&
      e.replyCode === "NOREPLICAS");
    assert.equal(c.stats().buffered, 1);
  } finally {
    await server.redis.config("SET", "min-replicas-to-write", "0");
  }
  await c.flush();
  assert.ok(await server.redis.zscore(shard0(c).due("user-stats"), "stats:user:r"));
  await c.close();
});

test("touches are refused once the pending keys reach limits.pending_keys", async () => {
  const c = await client("limits: {pending_keys: 3}");
  c.touchMany(["stats:user:1", "stats:user:2", "stats:user:3"]);
  await c.flush();
  const err = await pollUntil(() => {
    try {
      c.touch("stats:user:4");
      return null;
    } catch (e) {
      return e;
    }
  });
  assert.ok(err instanceof QuotaExceededError);
  assert.equal(err.limit, "pending_keys");
  await c.cancelMany(["stats:user:1", "stats:user:2", "stats:user:3", "stats:user:4"]);
  await c.close();
});

test("close rejects naming the keys it could not write; touch after close is refused", async () => {
  const other = await startServer();
  const c = await Coalescer.connect({ rulesYaml: rules(), redisUrl: other.url, logger: quiet });
  await other.redis.config("SET", "min-replicas-to-write", "1");
  c.touch("stats:user:lost");
  await assert.rejects(c.close(), (e) => e instanceof UnwrittenTouchesError &&
    e.keys.join() === "stats:user:lost" && /NOREPLICAS/.test(e.message));
  assert.throws(() => c.touch("stats:user:1"), ClosedError);
  await other.stop();
});

test("one write of keys of several rules, shards and sizes: every key lands", async () => {
  const c = await client("shards: 4");
  const users = Array.from({ length: 37 }, (_, i) => `stats:user:${i}`);
  const orders = Array.from({ length: 23 }, (_, i) => `orders:s${i % 3}:${i}`);
  c.touchMany(users);
  c.touchItems(orders.map((k) => [k, "row"]));
  c.touch("stats:user:later", null, { delay: "1m" });
  await c.flush();
  const space = new KeySpace(c.config.namespace, 4);
  const held = [];
  for (let shard = 0; shard < 4; shard++) {
    held.push(...await server.redis.zrange(space.shard(shard).due("user-stats"), 0, -1));
    held.push(...await server.redis.zrange(space.shard(shard).due("orders"), 0, -1));
  }
  assert.deepEqual(held.sort(), [...users, ...orders, "stats:user:later"].sort());
  const outcome = await c.cancelMany([...users.slice(0, 5), ...orders.slice(0, 5)]);
  assert.equal(outcome.cancelled.length, 10);
  await c.close();
});

async function scriptCalls() {
  const stats = await server.redis.info("commandstats");
  return [...stats.matchAll(/^cmdstat_(?:evalsha|eval):calls=(\d+)/gm)]
    .reduce((sum, m) => sum + Number(m[1]), 0);
}

test("a bulk flush goes out in calls of at most 500 keys: each holds Redis a millisecond or two", async () => {
  const c = await client();
  try {
    c.touch("stats:user:warm");
    await c.flush();
    const before = await scriptCalls();
    c.touchMany(Array.from({ length: 1250 }, (_, i) => `stats:user:${i}`));
    await c.flush();
    assert.equal(await scriptCalls() - before, 3); // 500, 500 and 250 keys
    assert.equal(await server.redis.zcard(shard0(c).due("user-stats")), 1251);
  } finally {
    await c.close();
  }
});

test("edge: leading: the first touch of a quiet key is due at once, the next ones a window on", async () => {
  n += 1;
  const yaml = `namespace: t${n}
rules:
  - name: lead
    match: "lead:{id}"
    window: 10s
    max_wait: 1m
    edge: leading
    handler: app:refresh
`;
  const c = await Coalescer.connect({ rulesYaml: yaml, redisUrl: server.url, logger: quiet });
  assert.equal(c.config.rules[0].leading, true);
  const before = await serverMs();
  c.touch("lead:1");
  await c.flush();
  const after = await serverMs();
  const s = shard0(c);
  const due = Number(await server.redis.zscore(s.due("lead"), "lead:1"));
  assert.ok(due >= before && due <= after, `due ${due} at once, in [${before}, ${after}]`);
  assert.ok(await server.redis.exists(s.quietPrefix + "lead:1"));
  await c.close();
  assert.throws(() => new Coalescer({ rulesYaml: 'rules:\n  - {name: a, match: "x", edge: sideways}\n' }),
    /rules\[0\]\.edge: edge must be trailing or leading/);
});

test("a key written lately is held for its rule's absorb: a hot key costs one write per interval", async () => {
  n += 1;
  const yaml = `namespace: t${n}
rules:
  - name: hot
    match: "hot:{id}"
    window: 10s
    absorb: 2s
    handler: app:refresh
`;
  const c = await Coalescer.connect({ rulesYaml: yaml, redisUrl: server.url, logger: quiet });
  c.touch("hot:1");
  await c.flush();
  assert.equal(c.stats().written, 1);
  for (let i = 0; i < 20; i++) {
    c.touch("hot:1");
    await new Promise((r) => setTimeout(r, 10)); // the background loop runs between touches
  }
  assert.equal(c.stats().written, 1); // held, not written again within its absorb
  assert.equal(c.stats().buffered, 1);
  await c.flush(); // flush writes held keys too
  assert.equal(c.stats().written, 2);
  await c.close();
});

test("Redis gone: flush rejects with RedisUnreachableError, close names the keys not written", async () => {
  const other = await startServer();
  const c = await Coalescer.connect({ rulesYaml: rules(), redisUrl: other.url, logger: quiet });
  await other.stop();
  c.touch("stats:user:gone-with-redis");
  await assert.rejects(c.flush(), RedisUnreachableError);
  assert.equal(c.stats().buffered, 1); // kept, for when Redis answers again
  await assert.rejects(c.close(), (e) => e instanceof UnwrittenTouchesError &&
    /"stats:user:gone-with-redis"/.test(e.message) && e.count === 1);
});

test("a key Redis refuses for itself is dropped and logged, every other key is written", async () => {
  const logged = [];
  const c = await client("", { logger: (level, m) => logged.push(`${level} ${m}`) });
  const s = shard0(c);
  await server.redis.hset(s.meta, "stats:user:corrupt", "not a state"); // a script error on it
  await server.redis.set(s.itemsPrefix + "orders:a:wrongtype", "a string"); // WRONGTYPE on SADD
  c.touchMany(["stats:user:corrupt", "stats:user:fine"]);
  c.touchItems([["orders:a:wrongtype", "i1"], ["orders:a:fine", "i2"]]);
  await c.flush();
  assert.ok(await server.redis.zscore(s.due("user-stats"), "stats:user:fine"));
  assert.ok(await server.redis.zscore(s.due("orders"), "orders:a:fine"));
  assert.equal(await server.redis.zscore(s.due("user-stats"), "stats:user:corrupt"), null);
  assert.deepEqual(await server.redis.smembers(s.itemsPrefix + "orders:a:fine"), ["i2"]);
  // (the WRONGTYPE key's state may be in: a script's writes before its error stay)
  const drops = logged.filter((m) => m.startsWith("error dropped key"));
  assert.equal(drops.length, 2, logged.join("\n"));
  assert.ok(drops.some((m) => m.includes('"stats:user:corrupt"')));
  assert.ok(drops.some((m) => m.includes('"orders:a:wrongtype"') && m.includes("WRONGTYPE")));
  assert.equal(c.stats().buffered, 0);
  await c.close();
});

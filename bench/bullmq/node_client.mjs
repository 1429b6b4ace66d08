// The Node client's side of `python -m bench.node_client`: one measurement per run.
//
//   node node_client.mjs '{"workload": "coalescer"|"bullmq", "url": "redis://...", "keys": N}'
//
// coalescer: N distinct keys touched from this process with clients/node (built by the
// bench: npm ci && npm run build), one touch() call per key, then flush(): keys/s from
// the first touch to flush() resolved (Redis holds them all), and what Redis holds.
// bullmq: the same N keys as BullMQ jobs with Queue.addBulk, 1,000 jobs a call, 4 calls
// in flight (pipelined, as its docs advise for bulk adds), each job with the options a
// debouncing user gives (bench/bullmq/peer.mjs: delay and deduplication): jobs/s.
// Prints one JSON object on stdout.
import { Queue } from "bullmq";
import IORedis from "ioredis";
import { Coalescer } from "../../clients/node/dist/index.js";

const req = JSON.parse(process.argv[2]);
const now = () => performance.now() / 1000;
const WINDOW_MS = 3_600_000;
const CHUNK = 1000;

// CPU seconds the Redis server has used so far (INFO cpu), and this process (user + system)
async function redisCpu(r) {
  const info = await r.info("cpu");
  const get = (name) => Number(new RegExp(`^${name}:([0-9.]+)`, "m").exec(info)[1]);
  return get("used_cpu_user") + get("used_cpu_sys");
}
const ownCpu = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };
// what a measurement cost: keys/s, and CPU µs a key of this process and of Redis
async function costs(r, keys, run) {
  const redis0 = await redisCpu(r);
  const own0 = ownCpu();
  const t0 = now();
  await run();
  const dt = now() - t0;
  const own = ownCpu() - own0;
  const redis = (await redisCpu(r)) - redis0;
  return { keys, seconds: dt, per_second: keys / dt, client_cpu_us: (own / keys) * 1e6,
           redis_cpu_us: (redis / keys) * 1e6 };
}
const IN_FLIGHT = 4;

const RULES = `namespace: bench
rules:
  - name: user-stats
    match: "stats:user:{user_id}"
    window: 1h
    max_wait: 2h
    handler: app:refresh
`;

async function coalescer() {
  const c = await Coalescer.connect({ rulesYaml: RULES, redisUrl: req.url, maxBuffered: req.keys + 1 });
  const keys = Array.from({ length: req.keys }, (_, i) => `stats:user:${i}`);
  const r = new IORedis(req.url);
  const out = await costs(r, req.keys, async () => {
    for (const key of keys) c.touch(key);
    await c.flush();
  });
  const held = await r.zcard("bench:{bench:0}:due:user-stats");
  r.disconnect();
  await c.close();
  return { ...out, redis_holds: held };
}

async function bullmq() {
  const u = new URL(req.url);
  const connection = new IORedis({ host: u.hostname, port: Number(u.port), maxRetriesPerRequest: null });
  const queue = new Queue("bench", { connection });
  await queue.waitUntilReady();
  const jobs = Array.from({ length: req.keys }, (_, i) => {
    const key = `stats:user:${i}`;
    return { name: "refresh", data: { key }, opts: { delay: WINDOW_MS, removeOnComplete: true,
      removeOnFail: true, deduplication: { id: key, ttl: WINDOW_MS, extend: true, replace: true,
        keepLastIfActive: true } } };
  });
  let next = 0;
  const lane = async () => {
    while (next < jobs.length) {
      const part = jobs.slice(next, next + CHUNK);
      next += CHUNK;
      await queue.addBulk(part);
    }
  };
  const r = new IORedis(req.url);
  const out = await costs(r, req.keys, () => Promise.all(Array.from({ length: IN_FLIGHT }, lane)));
  r.disconnect();
  const held = (await queue.getJobCounts("delayed")).delayed;
  await queue.close();
  connection.disconnect();
  return { ...out, redis_holds: held };
}

const out = req.workload === "coalescer" ? await coalescer() : await bullmq();
process.stdout.write(`${JSON.stringify(out)}\n`);
process.exit(0);

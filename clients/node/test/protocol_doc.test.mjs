// docs/protocol.md holds against this client too: its protocol version, the shard
// function's vectors, the pattern vectors, and the name of every key this client builds
// (each one the document lists for a client). A change on either side fails here.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { KeyPattern, KeySpace, PROTOCOL_VERSION, ShardKeys, keyHash } from "../dist/index.js";
import { drainedKey, layoutKey } from "../dist/keys.js";
import { protocolKey } from "../dist/protocol.js";
import { repo } from "./servers.mjs";

const doc = readFileSync(join(repo, "docs", "protocol.md"), "utf8");

/** The text of the section whose heading starts with `title`, to the next heading. */
function section(title) {
  const lines = doc.split("\n");
  const start = lines.findIndex((l) => /^#+ /.test(l) && l.replace(/^#+ /, "").startsWith(title));
  assert.ok(start >= 0, `docs/protocol.md has no section ${JSON.stringify(title)}`);
  const end = lines.findIndex((l, i) => i > start && /^#+ /.test(l));
  return lines.slice(start + 1, end < 0 ? undefined : end).join("\n");
}

/** The first markdown table of `text`: its rows of cells, header and rule left out. */
function table(text) {
  const rows = text.split("\n").filter((l) => l.startsWith("|"))
    .map((l) => l.trim().replace(/^\||\|$/g, "").split(/(?<!\\)\|/).map((c) => c.trim()));
  return rows.slice(2);
}

const code = (cell) => (/`([^`]*)`/.exec(cell) ?? [null, cell])[1];

test("the protocol version is the document's", () => {
  const rows = table(doc.split("## What a client does")[0]);
  assert.deepEqual(rows.map((r) => code(r[0])), [PROTOCOL_VERSION]);
});

test("the shard function gives the document's vectors", () => {
  const rows = table(section("The shard function"));
  assert.ok(rows.length >= 5, "the document's shard vectors");
  for (const [keyCell, crc, ...shards] of rows) {
    const key = code(keyCell);
    assert.equal(keyHash(key), Number(crc), key);
    assert.deepEqual([1, 4, 16, 256].map((n) => new KeySpace("NS", n).shardOf(key)),
      shards.map(Number), key);
  }
});

test("patterns match the document's vectors", () => {
  const rows = table(section("Rules: which rule a key follows"));
  assert.ok(rows.length >= 10, "the document's pattern vectors");
  for (const [pattern, key, matches] of rows) {
    assert.equal(KeyPattern.compile(code(pattern)).matches(code(key)), matches === "yes",
      `${pattern} ~ ${key}`);
  }
});

test("every key this client builds is one the document lists for a client", () => {
  const listed = new Map(table(section("Keys and hash tags")).map((r) => [code(r[0]), r[2]]));
  const shard = new ShardKeys("NS", "N");
  const built = [shard.meta, shard.nextWake, shard.wakeChannel, shard.layout, shard.seq,
    shard.moving, shard.bytes, shard.history, shard.due("RULE"), shard.dead("RULE"),
    `${shard.itemsPrefix}KEY`, `${shard.claimedPrefix}KEY`, `${shard.tracesPrefix}KEY`,
    `${shard.quietPrefix}KEY`, shard.arrived, shard.ruleNames, layoutKey("NS"), drainedKey("NS"),
    protocolKey("NS")];
  for (const key of built) {
    assert.ok(listed.has(key), `docs/protocol.md does not list ${key}`);
    assert.notEqual(listed.get(key), "-", `docs/protocol.md says a client never uses ${key}`);
  }
});

// The scripts this client sends are the Python package's, byte for byte: their SHA-1s
// equal those of a fresh `python -m conformance.export_scripts` (docs/protocol.md), and
// the protocol version is the one the Python package writes.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { PROTOCOL_VERSION } from "../dist/index.js";
import { scriptSource } from "../dist/scripts.js";
import { repo } from "./servers.mjs";

const python = join(repo, ".venv", "bin", "python");

test("every script a client calls is sent exactly as the Python package exports it",
  { skip: existsSync(python) ? false : `no Python venv at ${python}` }, () => {
    const dir = mkdtempSync(join(tmpdir(), "coalescer-export-"));
    try {
      execFileSync(python, ["-m", "conformance.export_scripts", dir], { cwd: repo, stdio: "ignore" });
      const manifest = JSON.parse(readFileSync(join(dir, "manifest.json"), "utf8"));
      assert.equal(manifest.protocol, PROTOCOL_VERSION);
      assert.ok(Object.keys(manifest.scripts).length >= 5);
      for (const [name, sha] of Object.entries(manifest.scripts)) {
        const mine = createHash("sha1").update(scriptSource(name), "utf8").digest("hex");
        assert.equal(mine, sha, `${name}.lua differs from the Python package's`);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

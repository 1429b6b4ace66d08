// Copies the Lua scripts the client runs from the Python package (coalescer/store/lua/)
// into dist/lua/ at build time: the client runs the very same files, never a hand-edited
// copy. Run by `npm run build`.
import { copyFileSync, mkdirSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const from = join(here, "..", "..", "..", "coalescer", "store", "lua");
const to = join(here, "..", "dist", "lua");
mkdirSync(to, { recursive: true });
let n = 0;
for (const name of readdirSync(from)) {
  if (name.endsWith(".lua")) {
    copyFileSync(join(from, name), join(to, name));
    n += 1;
  }
}
console.log(`copied ${n} Lua scripts from ${from} to ${to}`);

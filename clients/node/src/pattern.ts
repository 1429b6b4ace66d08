/**
 * Key patterns of rules, matched as coalescer/config/patterns.py and matcher.py match
 * them: `{name}` captures one non-empty segment without ':' (nor NUL), `*` matches
 * anything but NUL (':' too), the rest is literal text, and the whole key must match.
 * Matching takes time linear in the key's length whatever the pattern: one table per
 * token, filled from the key's end (no backtracking).
 */

const TOKEN_RE = /\{[^{}]*\}|[{}]|\*+|[^{}*]+/g;
const IDENT_RE = /^[A-Za-z_][A-Za-z0-9_]*$/;

type Token = { kind: "literal"; text: string } | { kind: "capture" } | { kind: "anything" };

export class KeyPattern {
  private readonly tokens: Token[];
  /** The literal text every key this pattern matches starts with. */
  readonly prefix: string;
  private readonly suffix: string;
  private readonly shortest: number;
  private readonly fast: RegExp | null;

  private constructor(readonly source: string, tokens: Token[]) {
    this.tokens = tokens;
    const first = tokens[0];
    const last = tokens[tokens.length - 1];
    this.prefix = first?.kind === "literal" ? first.text : "";
    this.suffix = tokens.length > 1 && last.kind === "literal" ? last.text : "";
    this.shortest = tokens.reduce(
      (n, t) => n + (t.kind === "literal" ? t.text.length : t.kind === "capture" ? 1 : 0), 0);
    this.fast = fastRegExp(tokens);
  }

  /** Compile `source`; throws an Error saying what is wrong and what is allowed. */
  static compile(source: unknown): KeyPattern {
    const allowed = "a pattern is literal text with {name} captures (one non-empty segment " +
      "without ':', name an identifier, each name once) and * wildcards (anything, ':' " +
      "included); no key may contain a NUL character";
    if (typeof source !== "string" || source === "") {
      throw new Error(`empty pattern ${JSON.stringify(source)}: ${allowed}`);
    }
    const tokens: Token[] = [];
    const names = new Set<string>();
    for (const text of source.match(TOKEN_RE) ?? []) {
      if (text === "{" || text === "}") {
        throw new Error(`unbalanced '${text}' in pattern ${JSON.stringify(source)}: ${allowed}`);
      }
      if (text.startsWith("*")) {
        tokens.push({ kind: "anything" });
      } else if (!text.startsWith("{")) {
        tokens.push({ kind: "literal", text });
      } else {
        const name = text.slice(1, -1);
        if (!name) throw new Error(`empty braces {} in pattern ${JSON.stringify(source)}: ${allowed}`);
        if (!IDENT_RE.test(name)) {
          throw new Error(`capture name ${JSON.stringify(name)} in pattern ` +
            `${JSON.stringify(source)} is not an identifier: ${allowed}`);
        }
        if (names.has(name)) {
          throw new Error(`capture name ${JSON.stringify(name)} appears twice in pattern ` +
            `${JSON.stringify(source)}: ${allowed}`);
        }
        names.add(name);
        tokens.push({ kind: "capture" });
      }
    }
    return new KeyPattern(source, tokens);
  }

  /** Whether the whole `key` matches. */
  matches(key: string): boolean {
    if (this.fast !== null) return this.fast.test(key);
    if (key.length < this.shortest || !key.startsWith(this.prefix) || !key.endsWith(this.suffix)) {
      return false;
    }
    let after = new Uint8Array(key.length + 1);
    after[key.length] = 1;
    for (let t = this.tokens.length - 1; t >= 0; t--) {
      const token = this.tokens[t];
      if (token.kind === "literal") after = literalTable(token.text, key, after);
      else if (token.kind === "capture") after = runTable(key, after, true);
      else after = runTable(key, after, false);
    }
    return after[0] === 1;
  }
}

/** One pass with a sticky expression when it gives the same answers: no wildcard, and
 * each capture last or followed by literal text that starts with ':' (a capture then
 * takes its whole run up to the next ':', as matcher.py's possessive expression does). */
function fastRegExp(tokens: Token[]): RegExp | null {
  const parts: string[] = [];
  for (let i = 0; i < tokens.length; i++) {
    const token = tokens[i];
    if (token.kind === "anything") return null;
    if (token.kind === "literal") {
      parts.push(token.text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
      continue;
    }
    const next = tokens[i + 1];
    if (next !== undefined && !(next.kind === "literal" && next.text.startsWith(":"))) return null;
    parts.push("[^:\\0]+");
  }
  return new RegExp(`^${parts.join("")}$`);
}

function literalTable(text: string, key: string, after: Uint8Array): Uint8Array {
  const table = new Uint8Array(after.length);
  let at = key.indexOf(text);
  while (at >= 0) {
    if (after[at + text.length]) table[at] = 1;
    at = key.indexOf(text, at + 1);
  }
  return table;
}

/** A capture (at least one character, no ':' nor NUL) or a wildcard (no NUL): within
 * each run of characters it may take, every position up to the last one at which the
 * rest matches, matches. */
function runTable(key: string, after: Uint8Array, capture: boolean): Uint8Array {
  const table = new Uint8Array(after.length);
  let start = 0;
  while (start <= key.length) {
    let end = start;
    while (end < key.length) {
      const c = key.charCodeAt(end);
      if (c === 0 || (capture && c === 58)) break;
      end++;
    }
    const first = capture ? start + 1 : start;
    let last = -1;
    for (let j = end; j >= first; j--) {
      if (after[j]) { last = j; break; }
    }
    if (last >= 0) {
      const upto = capture ? last : last + 1;
      table.fill(1, start, upto);
    }
    start = end + 1;
  }
  return table;
}

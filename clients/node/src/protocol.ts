/**
 * The touch protocol's version a namespace's keys follow, stored in Redis at
 * `NS:{NS:nodes}:protocol` as "MAJOR.MINOR" (coalescer/store/protocol_version.py): the
 * first client writes its own (SET NX); every client reads it at start and refuses a
 * major version it does not speak, naming both. Minor versions only add.
 */
import type { Client } from "./scripts.js";
import { ProtocolVersionError } from "./errors.js";

export const MAJOR = 1;
export const MINOR = 0;
export const VERSION = `${MAJOR}.${MINOR}`;
const FORM = /^(\d{1,6})\.(\d{1,6})$/;

export function protocolKey(namespace: string): string {
  return `${namespace}:{${namespace}:nodes}:protocol`;
}

/** The error for a stored version this client cannot follow (null: it can). */
export function refusal(namespace: string, stored: string): ProtocolVersionError | null {
  const m = FORM.exec(stored);
  if (m && Number(m[1]) === MAJOR) return null;
  const what = m ? `version ${stored}` : `an unreadable version ${JSON.stringify(stored.slice(0, 40))}`;
  return new ProtocolVersionError(stored, VERSION,
    `namespace ${JSON.stringify(namespace)} follows touch protocol ${what} (stored in ` +
    `${protocolKey(namespace)}), and this client (@coalescer/client) speaks version ` +
    `${VERSION}: its keys would be written in a form the others do not read; upgrade the ` +
    "client, or use another namespace");
}

/** Read the namespace's version, writing ours when there is none; the version it follows. */
export async function checkVersion(client: Client, namespace: string,
                                   log: (m: string) => void): Promise<string> {
  const key = protocolKey(namespace);
  let stored = await client.get(key);
  if (stored === null) {
    try {
      await client.set(key, VERSION, "NX");
    } catch (e) {
      log(`could not write the touch protocol version to ${key}: ${(e as Error).message}`);
      return VERSION;
    }
    stored = await client.get(key);
    if (stored === null) return VERSION;
  }
  const wrong = refusal(namespace, stored);
  if (wrong !== null) throw wrong;
  return stored;
}

"""A Node.js writer (the TypeScript client, clients/node) touching keys that a Python
node refreshes: ``python -m examples.node_writer.demo``."""

"""Likes (the source of truth) and post_likes (one count per post), in SQLite, and the
refresh handler that recounts one post.

The node imports this file as ``post_likes`` (rules.yaml); the Flask app as
``examples.sync_app.post_likes``. The database is ``$LIKES_DB``, else ``likes.db``
beside this file.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from coalescer import Claim

DB_ENV = "LIKES_DB"
KEY_FORMAT = "likes:post:{}"

SCHEMA = """
CREATE TABLE IF NOT EXISTS likes (
    post_id INTEGER NOT NULL,
    user TEXT NOT NULL,
    PRIMARY KEY (post_id, user)
);
CREATE TABLE IF NOT EXISTS post_likes (
    post_id INTEGER PRIMARY KEY,
    likes INTEGER NOT NULL,
    token INTEGER NOT NULL             -- fencing token of the refresh that wrote it
);
"""

# Written only by a refresh holding a newer claim than the last writer's.
FENCED_UPSERT = """
INSERT INTO post_likes (post_id, likes, token) VALUES (?, ?, ?)
ON CONFLICT (post_id) DO UPDATE SET likes = excluded.likes, token = excluded.token
WHERE excluded.token > post_likes.token
"""


def connect() -> sqlite3.Connection:
    path = os.environ.get(DB_ENV) or Path(__file__).resolve().with_name("likes.db")
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def init_db() -> None:
    conn = connect()
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(SCHEMA)
    finally:
        conn.close()


def add_like(post_id: int, user: str) -> bool:
    """Record one like (autocommit: committed on return); False if it was there."""
    conn = connect()
    try:
        cursor = conn.execute("INSERT OR IGNORE INTO likes (post_id, user) VALUES (?, ?)",
                              (post_id, user))
        return cursor.rowcount == 1
    finally:
        conn.close()


def read_count(post_id: int) -> int | None:
    conn = connect()
    try:
        row = conn.execute("SELECT likes FROM post_likes WHERE post_id = ?",
                           (post_id,)).fetchone()
        return None if row is None else int(row[0])
    finally:
        conn.close()


def refresh_post(claim: Claim) -> None:
    """The handler rules.yaml names: recount one post, write the count fenced."""
    post_id = int(claim.params["post_id"])
    conn = connect()
    try:
        (count,) = conn.execute("SELECT COUNT(*) FROM likes WHERE post_id = ?",
                                (post_id,)).fetchone()
        conn.execute(FENCED_UPSERT, (post_id, count, claim.token))
    finally:
        conn.close()

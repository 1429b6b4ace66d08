"""The example's data: reviews in SQLite, and the refresh handler that recomputes a
product's rating from them (the aggregate the app serves).

The database is ``$RATINGS_DB``, else ``ratings.db`` beside this file.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from coalescer import Claim

SCHEMA = """
CREATE TABLE IF NOT EXISTS reviews (product INTEGER NOT NULL, stars INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ratings (product INTEGER PRIMARY KEY, reviews INTEGER NOT NULL,
                                    stars REAL NOT NULL);
"""


def connect() -> sqlite3.Connection:
    """A connection to the database, its tables created if they are not there yet."""
    db = sqlite3.connect(os.environ.get("RATINGS_DB") or Path(__file__).with_name("ratings.db"))
    db.executescript(SCHEMA)
    return db


def add_review(product: int, stars: int) -> None:
    with closing(connect()) as db, db:
        db.execute("INSERT INTO reviews (product, stars) VALUES (?, ?)", (product, stars))


def rating(product: int) -> dict[str, Any] | None:
    """The product's rating as last refreshed; None before its first refresh."""
    with closing(connect()) as db:
        row = db.execute("SELECT reviews, stars FROM ratings WHERE product = ?",
                         (product,)).fetchone()
    return None if row is None else {"product": product, "reviews": row[0], "stars": row[1]}


def refresh_rating(claim: Claim) -> None:
    """The rule's handler: the product's review count and mean stars, from every review
    (no rating for a product without reviews)."""
    product = int(claim.params["product_id"])
    with closing(connect()) as db, db:
        count, stars = db.execute("SELECT COUNT(*), ROUND(AVG(stars), 2) FROM reviews "
                                  "WHERE product = ?", (product,)).fetchone()
        if not count:
            db.execute("DELETE FROM ratings WHERE product = ?", (product,))
            return
        db.execute("INSERT INTO ratings (product, reviews, stars) VALUES (?, ?, ?) "
                   "ON CONFLICT (product) DO UPDATE SET reviews = excluded.reviews, "
                   "stars = excluded.stars", (product, count, stars))

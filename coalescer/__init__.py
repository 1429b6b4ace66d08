"""coalescer: debounce and coalesce refreshes of aggregates, across processes, on Redis."""

from __future__ import annotations

from .claim import Claim
from .coalescer import Coalescer
from .errors import (
    BackpressureError,
    ClosedError,
    CoalescerError,
    ConfigError,
    InvalidKeyError,
    KeyRefusedError,
    UnknownKeyError,
    WebhookError,
)
from .rules import Config, Rule
from .sync import SyncCoalescer

__all__ = [
    "BackpressureError",
    "Claim",
    "ClosedError",
    "Coalescer",
    "CoalescerError",
    "Config",
    "ConfigError",
    "InvalidKeyError",
    "KeyRefusedError",
    "Rule",
    "SyncCoalescer",
    "UnknownKeyError",
    "WebhookError",
]

"""coalescer: debounce and coalesce refreshes of aggregates, across processes, on Redis."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from coalescer.claim import Claim
from coalescer.coalescer import Coalescer
from coalescer.config.code_rules import Rule, Rules
from coalescer.config.rules import Config
from coalescer.errors import (
    BackpressureError,
    ClosedError,
    CoalescerError,
    ConfigError,
    EvictionPolicyError,
    InvalidItemError,
    InvalidKeyError,
    InvalidPriorityError,
    InvalidScheduleError,
    KeyRefusedError,
    ProtocolVersionError,
    QuotaExceededError,
    RedisAuthenticationError,
    RedisConnectError,
    RedisRefusesWritesError,
    RedisUnreachableError,
    RedisUrlError,
    RedisWriteError,
    ReplicationError,
    SourceReadError,
    UnknownKeyError,
    UnwrittenTouchesError,
    WebhookError,
)
from coalescer.sync import SyncCoalescer
from coalescer.write.cancel import CancelOutcome

try:
    __version__ = _version("coalescer")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "BackpressureError",
    "CancelOutcome",
    "Claim",
    "ClosedError",
    "Coalescer",
    "CoalescerError",
    "Config",
    "ConfigError",
    "EvictionPolicyError",
    "InvalidItemError",
    "InvalidKeyError",
    "InvalidPriorityError",
    "InvalidScheduleError",
    "KeyRefusedError",
    "ProtocolVersionError",
    "QuotaExceededError",
    "RedisAuthenticationError",
    "RedisConnectError",
    "RedisRefusesWritesError",
    "RedisUnreachableError",
    "RedisUrlError",
    "RedisWriteError",
    "ReplicationError",
    "Rule",
    "Rules",
    "SourceReadError",
    "SyncCoalescer",
    "UnknownKeyError",
    "UnwrittenTouchesError",
    "WebhookError",
    "__version__",
]

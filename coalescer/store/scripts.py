"""``Scripts``: every Lua script of ``lua/``, registered once per client, each behind a
small typed method.

The methods live with their side: claiming and finishing claims
(``claim_scripts.py``), writing and cancelling keys (``write_scripts.py``), leaderships
and node leases (``lease_scripts.py``), an operator's asks (``operator_scripts.py``);
how a call runs is ``script_calls.py``, what the calls take and answer
``script_types.py``.
"""

from __future__ import annotations

from coalescer.store.claim_scripts import ClaimScripts
from coalescer.store.lease_scripts import LeaseScripts
from coalescer.store.operator_scripts import OperatorScripts
from coalescer.store.write_scripts import WriteScripts

__all__ = ["Scripts"]


class Scripts(ClaimScripts, WriteScripts, LeaseScripts, OperatorScripts):
    """The registered scripts of one Redis (or Redis Cluster) client."""

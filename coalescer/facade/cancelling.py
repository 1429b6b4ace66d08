"""``Cancelling``: dropping pending refreshes, of named keys (buffered touches
included) or of a rule's keys scheduled after a time."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from coalescer.common.audit_log import local_user
from coalescer.common.plural import plural
from coalescer.config.schedule import At
from coalescer.facade.core import Core
from coalescer.store.keycheck import check_key
from coalescer.store.script_types import History
from coalescer.write.cancel import CancelOutcome, cancel_keys
from coalescer.write.cancel_scheduled import bulk_cancel, cancel_rule_scheduled

log = logging.getLogger(__name__)


class Cancelling:
    """The cancels of one coalescer (see ``Coalescer.cancel_many``)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def cancel_many(self, keys: Iterable[str]) -> CancelOutcome:
        core = self.core
        keys = list(dict.fromkeys(keys))
        run = core._running("cancel()")
        rules: dict[str, str] = {}
        for key in keys:
            check_key(key)
            rules[key] = core.config.rule_for(key).name
        assert run.flusher is not None and run.scripts is not None
        async with core._explained():
            buffered = await run.flusher.forget(keys)
            outcome = await cancel_keys(run.scripts, core.keyspace, rules,
                                        history=History(core.node_id, core.config.history),
                                        buffered=buffered)
        for key in outcome.cancelled:
            run.metrics.cancels.labels(rules[key]).inc()
        log.info("cancel: %d of %s dropped (%d not pending)", outcome.done,
                 plural(len(keys), "key"), len(outcome.not_pending))
        return outcome

    async def cancel_scheduled(self, rule: str, after: At, dry_run: bool,
                               who: str | None) -> int:
        core = self.core
        run = core._running("cancel_scheduled()")
        assert run.scripts is not None
        bulk = bulk_cancel(core.config, rule, after, core.node_id, dry_run)
        return await cancel_rule_scheduled(run.scripts, core.keyspace, bulk,
                                           who or local_user(), core.audit)

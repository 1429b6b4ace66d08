"""The time a source's event gives its touch: the source's ``at:`` or ``delay:``
template (config/sources.py, any source type) filled from the event's fields.

A source type reads an event's key (and item) as it likes, then asks ``time_of`` for
the time, handing it a lookup of the event's fields by name. An event whose time
cannot be made (a field missing, a time refused: see config/schedule.py) is rejected
like an event with a missing key field: counted, acknowledged, logged with its id,
never blocking the source. The touches that carry a time go in with ``touch_timed``
(NodeContext), all or none.
"""

from __future__ import annotations

from collections.abc import Callable

from coalescer.config.schedule import HORIZON, schedule_spec
from coalescer.config.sources import SourceConfig
from coalescer.config.templates import TemplateOverflow
from coalescer.errors import InvalidScheduleError

Timed = tuple[str, str | None, str]  # key, item (None: none), the time's wire form
TouchTimed = Callable[[list[Timed]], None]  # touches with a time each, all or none
Field = Callable[[str], str | None]  # an event's field by name; None when it has none


def time_of(source: SourceConfig, key: str, field: Field,
            ahead: float = HORIZON) -> tuple[str | None, str]:
    """The wire form of the time the event's touch of ``key`` carries (None when the
    source has no ``at:``/``delay:``), and why the event is rejected ("" when it is not):
    a time before 1970 or more than ``ahead`` seconds ahead (the rules file's
    ``limits.max_schedule_ahead``) is."""
    template = source.at or source.delay
    if template is None:
        return None, ""
    which = "at" if source.at is not None else "delay"
    values: dict[str, str] = {}
    for name in template.fields:
        value = field(name)
        if value is None:
            return None, f"it has no field {name!r} (for its {which})"
        values[name] = value
    try:
        text = template.fill(values)
        spec = (schedule_spec(key, at=text, ahead=ahead) if which == "at"
                else schedule_spec(key, delay=text, ahead=ahead))
    except (InvalidScheduleError, TemplateOverflow) as exc:
        return None, str(exc)
    assert spec is not None
    return spec, ""

"""Values derived from one Schedule object, computed once while it lives.

A lowered schedule is simulated many times with different prices (`mhcpipe tune` prices hundreds of layouts on a
few cached schedules): what depends on the schedule alone (the engine's channels and stage needs, the live
activation counts) is computed once per object. A Schedule is frozen but holds 10^4-10^6 actions, so it is keyed
by identity rather than hashed, and its entries go when it is collected.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from schedules.ir import Schedule

_VALUES: dict[tuple[int, str], Any] = {}


def derived(schedule: Schedule, name: str, make: Callable[[], Any]) -> Any:
    """`make()` for `schedule` under `name`, computed on the first call for this object. Callers must not
    change what it returns."""
    key = (id(schedule), name)
    try:
        return _VALUES[key]
    except KeyError:
        pass
    value = _VALUES[key] = make()
    weakref.finalize(schedule, _VALUES.pop, key, None)
    return value


def recalled(schedule: Schedule, name: str) -> Any:
    """What `derived` holds for `schedule` under `name`, None when nothing yet (a value made only once something
    else has happened: schedules.replay's plan, after a run that completed)."""
    return _VALUES.get((id(schedule), name))

"""How a scale request names the runtimes it wants (docs/rebalancing.md "Scaling"): a signed change ("+1", "-2", or a
negative number) or the count wanted (3, "3"). Shared by `POST /admin/scale` and `amoe scale`, so both refuse the
same input with the same words."""

from __future__ import annotations

import re
from typing import Any

from amoe.errors import RequestError

_TEXT = re.compile(r"[+-]?[0-9]{1,6}")


def target_count(value: Any, current: int, param: str) -> int:
    """The number of runtimes `value` asks for, given `current`; RequestError naming `param` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RequestError(f"'{param}' must be a count (3) or a change (\"+1\", -1); got {value!r}", param)
    text = str(value).strip()
    if not _TEXT.fullmatch(text):
        raise RequestError(f"'{param}' must be a count (3) or a change (\"+1\", -1); got {value!r}", param)
    number = int(text)
    return current + number if text[0] in "+-" else number


def check_count(wanted: int, current: int, room: int, param: str) -> None:
    """At least one runtime of a role stays; no more join than the cluster has free slots (`room`)."""
    if wanted < 1:
        raise RequestError(f"'{param}' would leave {wanted} runtimes; at least one must serve", param)
    if wanted - current > room:
        raise RequestError(
            f"'{param}' asks for {wanted - current} more runtimes; {room} slots are free (--max-runtimes)",
            param,
        )

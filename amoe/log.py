"""Logging set up once, by the entry point: time, level, a bracketed area prefix such as [model], on stderr."""

from __future__ import annotations

import logging
import re
import sys

from amoe import envs
from amoe.errors import ConfigError

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(area)s%(message)s"
_DATE_FORMAT = "%H:%M:%S"
_ROOT_LOGGERS = (
    "amoe",
    "coordinator",
)  # the packages whose loggers we own; libraries' loggers stay untouched


_TAGGED = re.compile(r"\[[\w.-]+\] ")


class _AreaFormatter(logging.Formatter):
    """Prefixes the area from the logger name (amoe.model.checkpoint → [model]), unless the message has one."""

    def format(self, record: logging.LogRecord) -> str:
        has_tag = isinstance(record.msg, str) and _TAGGED.match(record.msg)
        record.area = "" if has_tag else f"[{area_of(record.name)}] "
        return super().format(record)


def area_of(logger_name: str) -> str:
    """The bracketed prefix for a logger: the subpackage of amoe, or the top-level package otherwise."""
    parts = logger_name.split(".")
    if parts[0] == "amoe" and len(parts) > 1:
        return parts[1]
    return parts[0]


def setup_logging(verbose: bool = False) -> None:
    """Send amoe's logs to stderr; idempotent. Level: DEBUG if verbose, else $AMOE_LOG_LEVEL, else INFO."""
    level = logging.DEBUG if verbose else _env_level()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_AreaFormatter(_FORMAT, _DATE_FORMAT))
    for name in _ROOT_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_amoe", False)]:
            logger.removeHandler(old)  # calling twice replaces the handler instead of doubling every line
        handler._amoe = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def _env_level() -> int:
    name = envs.AMOE_LOG_LEVEL
    if name is None:
        return logging.INFO
    level = logging.getLevelName(name)  # an int for a known name, else the string "Level <name>"
    if not isinstance(level, int):
        raise ConfigError(f"AMOE_LOG_LEVEL={name!r} is not a log level (DEBUG, INFO, WARNING, ERROR)")
    return level

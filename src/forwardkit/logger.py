"""Logging for forwardkit: ``init_logger(__name__)`` and once-only helpers.

All forwardkit loggers hang below the ``forwardkit`` logger, which gets one stderr
handler the first time a logger is made; its level comes from ``FORWARDKIT_LOGGING_LEVEL``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from functools import cache

__all__ = ["ForwardkitLogger", "init_logger"]

_ROOT = "forwardkit"
_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    from forwardkit import envs

    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
    level = envs.FORWARDKIT_LOGGING_LEVEL
    root.setLevel(level if level in logging._nameToLevel else "INFO")
    root.propagate = False
    _configured = True


class ForwardkitLogger(logging.LoggerAdapter):
    """A logger with ``debug_once`` / ``info_once`` / ``warning_once``.

    The ``*_once`` variants log a given (message, args) pair only the first time in the
    process, which is what per-step code paths need.
    """

    def process(self, msg: object, kwargs: MutableMapping[str, object]
                ) -> tuple[object, MutableMapping[str, object]]:
        return msg, kwargs

    def _once(self, level: int, msg: str, *args: object) -> None:
        _log_once(self.logger.name, level, msg, args)

    def debug_once(self, msg: str, *args: object) -> None:
        """Log at DEBUG once per process for this message and arguments."""
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg: str, *args: object) -> None:
        """Log at INFO once per process for this message and arguments."""
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg: str, *args: object) -> None:
        """Log at WARNING once per process for this message and arguments."""
        self._once(logging.WARNING, msg, *args)


@cache
def _log_once(name: str, level: int, msg: str, args: tuple[object, ...]) -> None:
    logging.getLogger(name).log(level, msg, *args, stacklevel=4)


def init_logger(name: str) -> ForwardkitLogger:
    """Return the logger for module ``name`` (placed under the ``forwardkit`` logger)."""
    _configure_root()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return ForwardkitLogger(logging.getLogger(name), {})

"""``nixl.logging`` on Ferry: ``get_logger(name)`` returns ``nixl.<name>``; the
first call gives the ``nixl`` logger a stdout handler at INFO (NIXL's default),
or at the level NIXL_LOG_LEVEL names (TRACE, DEBUG, INFO, WARN, ERROR, FATAL)."""
from __future__ import annotations

import logging as _logging
import os
import sys

_LEVELS = {"TRACE": _logging.DEBUG, "DEBUG": _logging.DEBUG, "INFO": _logging.INFO,
           "WARN": _logging.WARNING, "WARNING": _logging.WARNING, "ERROR": _logging.ERROR,
           "FATAL": _logging.CRITICAL}
_ready = False


def _set_up() -> None:
    global _ready
    if _ready:
        return
    _ready = True
    root = _logging.getLogger("nixl")
    wanted = os.environ.get("NIXL_LOG_LEVEL", "INFO").upper()
    root.setLevel(_LEVELS.get(wanted, _logging.INFO))
    if wanted not in _LEVELS:
        root.warning("NIXL_LOG_LEVEL=%r is not a level; using INFO", wanted)
    handler = _logging.StreamHandler(sys.stdout)
    handler.setFormatter(_logging.Formatter("%(asctime)s NIXL(ferry) %(levelname)-7s "
                                            "%(filename)s:%(lineno)d %(message)s",
                                            "%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False


def get_logger(name: str) -> _logging.Logger:
    _set_up()
    return _logging.getLogger("nixl." + name.lstrip("_"))

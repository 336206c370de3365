"""vlax's log lines (backend choice, batch buckets, fallbacks) on stderr, as vLLM prints its own.

Quiet by default: warnings and errors only. `vlax generate -v` (or VLAX_LOG_LEVEL=INFO) shows
the INFO lines: which attention backend serves the model and why, each batch shape compiled.
Set VLAX_CONFIGURE_LOGGING=0 to leave logging entirely to the application.
"""

from __future__ import annotations

import logging
import os
import sys

_PACKAGES = ("vlax", "runtime", "model", "pallas_kernels")


def configure() -> None:
    if os.environ.get("VLAX_CONFIGURE_LOGGING", "1") == "0":
        return
    level = os.environ.get("VLAX_LOG_LEVEL", "WARNING").upper()
    for name in _PACKAGES:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s vlax %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)


def set_level(level: str) -> None:
    """Show vlax's lines from `level` up (the CLI's -v asks for INFO)."""
    if os.environ.get("VLAX_CONFIGURE_LOGGING", "1") == "0":
        return
    for name in _PACKAGES:
        logging.getLogger(name).setLevel(level)

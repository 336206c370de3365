"""vlax's log lines (backend choice, batch buckets, fallbacks) on stderr, as vLLM prints its own.

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
    level = os.environ.get("VLAX_LOG_LEVEL", "INFO").upper()
    for name in _PACKAGES:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s vlax %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)

"""The CPU's last-level cache size, read once at start-up: the most bytes of one intermediate
activation a layer computes at once on the CPU (model/layers/compute.py `row_parts`).

Measured on the 2-core AMD EPYC dev host (32 MiB L3, glibc keeping freed buffers mapped as the
engine runs): the benchmark PaliGemma's gated MLP (hidden 512, intermediate 2048) costs 31 us
per row at 2048 rows, whose [rows, 4096] f32 gate-up activation is 32 MiB, and 37-41 us per row
at 4096 rows (64 MiB), where computing it as two 2048-row halves gives 31-32 again; the whole
multimodal benchmark at a 4096-token budget took 9.4-10.3 s, and 7.8-8.1 with the halves (what
a 2048-token budget takes). Below the cache size the rows are computed at once, as before.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

_CPU0 = Path("/sys/devices/system/cpu/cpu0/cache")


@cache
def activation_limit() -> int | None:
    """The CPU runner's limit on one intermediate activation: the last-level cache, logged once."""
    size = last_level_cache_bytes()
    if size is None:
        log.info("CPU cache size unknown (sysfs): layers compute all their rows at once")
    else:
        log.info(
            "CPU last-level cache %d MiB: a gated MLP computes its rows in parts whose "
            "intermediate fits it",
            size >> 20,
        )
    return size


def last_level_cache_bytes(root: Path = _CPU0) -> int | None:
    """The size of the highest-level data or unified cache sysfs reports for cpu0; None where
    sysfs says nothing readable (then no layer splits its rows)."""
    best: tuple[int, int] | None = None
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _bytes((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or size is None:
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def _bytes(text: str) -> int | None:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text) if text.isdigit() else None

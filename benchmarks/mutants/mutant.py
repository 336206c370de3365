"""One mutant: a plausible one-line bug and the tests that exist for the code it breaks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # one whole source line, without its indentation; must occur exactly once
    mutated: str  # what replaces it (the line's indentation and ending are kept)
    tests: tuple[str, ...]  # the pytest subset run against it

"""glibc malloc keeps freed host buffers mapped (runtime/host_malloc.py), and the engine's flag
reaches it. The settings are process-wide, so each mode runs in a fresh interpreter."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from runtime.config import ConfigError, EngineConfig
from vlax import engine_flags

# Mallocs, touches and frees a 96 MiB block (over glibc's largest mmap threshold) a few times, as
# XLA:CPU does its step buffers (numpy would madvise huge pages), and reports the page faults of
# the rounds after the first.
_ROUNDS = """
import ctypes, json, resource, sys
if sys.argv[1] == "on":
    from runtime import host_malloc
    assert host_malloc.keep_freed_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def round_trip():
    block = libc.malloc(96 << 20)
    ctypes.memset(block, 1, 96 << 20)
    libc.free(block)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()  # the first round may grow the heap
start = faults()
for _ in range(4):
    round_trip()
print(json.dumps({"faults_per_round": (faults() - start) / 4}))
"""


def _faults_per_round(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])["faults_per_round"]


def test_freed_buffers_stay_mapped_instead_of_faulting_in_again():
    pages = (96 << 20) // 4096
    assert _faults_per_round("off") > pages / 2  # glibc's default: a fresh mapping each round
    assert _faults_per_round("on") < pages / 20


def test_the_flag_reaches_the_engine_config_and_a_bad_value_is_refused():
    parser = argparse.ArgumentParser()
    engine_flags.add_engine_flags(parser)
    assert engine_flags.engine_args(parser.parse_args([]))["keep_host_buffers"] is True
    args = parser.parse_args(["--no-keep-host-buffers"])
    assert engine_flags.engine_args(args)["keep_host_buffers"] is False
    pooling = argparse.ArgumentParser()
    engine_flags.add_engine_flags(pooling, pooling=True)
    args = pooling.parse_args(["--no-keep-host-buffers"])
    assert engine_flags.engine_args(args, pooling=True)["keep_host_buffers"] is False
    with pytest.raises(ConfigError, match="keep_host_buffers must be True or False, got 'yes'"):
        EngineConfig(model="m", keep_host_buffers="yes")

"""JAX's persistent compilation cache: a second process on the same checkpoint compiles nothing.

Each run is a fresh process (the in-memory jit caches die with it) with its own VLAX_CACHE_DIR,
so the embedded checkpoint and the compiled programs both live in a temp folder. Compilations
are counted through JAX's monitoring events: '/jax/core/compile/backend_compile_duration' fires
once per program handed to the backend, compiled or loaded from the persistent cache, and
'/jax/compilation_cache/cache_hits' once per program loaded; compiled = the first less the second.
"""

import json
import os
import subprocess
import sys

import pytest

_RUN = """
import json, sys
import jax
counts = {"programs": 0, "loaded": 0}
def on_duration(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["programs"] += 1
def on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        counts["loaded"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from runtime.core.request import SamplingParams
from vlax.llm import LLM
llm = LLM(compilation_cache=sys.argv[1] == "on", max_num_seqs=8, max_model_len=128)
outs = llm.generate(["hello there", "a longer prompt than the first"],
                    SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
counts["compiled"] = counts["programs"] - counts["loaded"]
print(json.dumps({**counts, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _run(env, cache: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _RUN, cache],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vlax_cache")
    env = {**os.environ, "VLAX_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # vlax's own directory, not one set outside
    return env


def test_second_process_compiles_nothing_and_generates_the_same(env):
    first = _run(env, "on")
    assert first["compiled"] > 0  # a cold cache: everything compiles
    assert os.listdir(os.path.join(env["VLAX_CACHE_DIR"], "jax"))
    second = _run(env, "on")
    assert second["compiled"] == 0, second
    assert second["loaded"] == second["programs"] == first["programs"], (first, second)
    assert second["tokens"] == first["tokens"]
    # Off: the same warm directory is not read, so everything compiles again.
    off = _run(env, "off")
    assert off["compiled"] >= first["compiled"] and off["loaded"] == 0, off
    assert off["tokens"] == first["tokens"]

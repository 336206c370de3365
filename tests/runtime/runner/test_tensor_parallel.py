"""Tensor and expert parallelism on simulated CPU devices, and a two-process multi-host engine.

JAX's device count is fixed when it starts, so the engines run in subprocesses
(parallel_worker.py) with XLA_FLAGS=--xla_force_host_platform_device_count=4; every engine of a
case runs in one subprocess, built once per module. Checked: greedy tokens identical for TP 1, 2
and 4 (also with the Pallas attention kernel, per device under shard_map), and for DeepSeek-V3 with
its experts' intermediate split or whole experts split (expert parallel; float32 tiny checkpoints,
so the split sums differ from one device's only by rounding), each
device holds exactly the replicated weights plus 1/T of the split ones (and 1/T of the K/V pools),
bad sizes refused with the numbers; two processes over jax.distributed on 127.0.0.1 (a 2 x 2 mesh)
give one process's tokens, and a process given another prompt is caught at the first step, by name,
in both processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from model.testing import write_tiny_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "parallel_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _last_json(stdout: str) -> dict:
    """The child's last JSON line: Gloo's C++ side may print its own lines to stdout after it."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"no JSON line in the child's stdout:\n{stdout}")
    # raw_decode: text another writer appended to the line after the JSON is left out.
    return json.JSONDecoder().raw_decode(lines[-1])[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        # 4 KV heads so that 4 devices can split them; Qwen3 for q/k norms and GQA (4 q heads
        # over 2 KV heads: TP 2 only).
        # Biases on every projection: fused q/k/v and gate/up biases split, o_proj and down_proj
        # biases added once, after the all-reduce.
        "llama": write_tiny_checkpoint(
            root / "llama",
            "llama",
            seed=3,
            num_key_value_heads=4,
            attention_bias=True,
            mlp_bias=True,
        ),
        "qwen3": write_tiny_checkpoint(root / "qwen3", "qwen3", seed=5),
        "llama_gqa": write_tiny_checkpoint(root / "gqa", "llama", seed=6),
        # MLA (heads split, latent replicated), one dense layer then MoE: 4 routed experts top-2
        # and a shared expert.
        "deepseek": write_tiny_checkpoint(root / "deepseek", "deepseek_v3", seed=7),
    }


@pytest.fixture(scope="module")
def results(checkpoints):
    cases = {
        "engines": {
            "llama": [checkpoints["llama"], [1, 2, 4], False],
            # The Pallas paged-attention kernel (interpret mode on the CPU, slow: first prompt,
            # 3 tokens) per device under shard_map: XLA cannot partition a kernel itself.
            "llama pallas": [checkpoints["llama"], [2], False, "pallas", 3],
            "qwen3": [checkpoints["qwen3"], [1, 2], False],
            "deepseek": [checkpoints["deepseek"], [1, 4], False],
            "deepseek ep": [checkpoints["deepseek"], [2], True],
        },
        "refusals": {
            "tp 3": [checkpoints["llama"], 3, False],
            "tp 8 of 4 devices": [checkpoints["llama"], 8, False],
            "tp 4 over 2 kv heads": [checkpoints["llama_gqa"], 4, False],
            "ep without experts": [checkpoints["llama"], 2, True],
            "ep 3 over 4 experts": [checkpoints["deepseek"], 3, True],
        },
    }
    run = subprocess.run(
        [sys.executable, WORKER, "engines", json.dumps(cases)],
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return _last_json(run.stdout)


def test_greedy_tokens_identical_for_every_tp(results):
    engines = results["engines"]
    pallas = engines["llama pallas tp=2"]["tokens"]
    assert pallas == [engines["llama tp=1"]["tokens"][0][:3]]
    for name, one_device, sizes in (
        ("llama", "llama", (2, 4)),
        ("qwen3", "qwen3", (2,)),
        ("deepseek", "deepseek", (4,)),
        ("deepseek ep", "deepseek", (2,)),
    ):
        one = engines[f"{one_device} tp=1"]["tokens"]
        assert all(len(t) == 8 for t in one)
        for tp in sizes:
            assert engines[f"{name} tp={tp}"]["tokens"] == one, (name, tp)


def test_each_device_holds_its_share(results):
    for key, got in results["engines"].items():
        tp = int(key.rsplit("=", 1)[1])
        # Every device holds the same bytes: the replicated arrays whole, 1/T of the split ones.
        (weights,) = got["weights_per_device"]
        assert weights == got["weights_replicated"] + got["weights_split"] // tp, key
        (kv,) = got["kv_per_device"]
        assert kv == got["kv_replicated"] + got["kv_split"] // tp, key
        if key.startswith("deepseek") and tp > 1:
            # The MLA latent pool is whole on every device, as vLLM keeps it; the latent
            # projections, router and norms are replicated, the rest split.
            assert got["kv_split"] == 0 and got["kv_replicated"] > 0, key
            assert got["weights_split"] > 2 * got["weights_replicated"], key
        elif tp > 1:
            # Attention, MLP, embedding and head are split (norms alone are replicated) and the
            # K/V pools are split by KV head.
            assert got["weights_split"] > 20 * got["weights_replicated"], key
            assert got["kv_replicated"] == 0, key
        else:
            assert got["weights_split"] == got["kv_split"] == 0, key


def test_bad_sizes_are_refused_with_the_numbers(results):
    refused = results["refusals"]
    assert "tensor_parallel_size=3 must divide" in refused["tp 3"]
    assert "num_attention_heads=4" in refused["tp 3"]
    assert "num_key_value_heads=4" in refused["tp 3"]
    assert "intermediate_size=128" in refused["tp 3"]
    assert "tensor_parallel_size=8 needs 8 devices" in refused["tp 8 of 4 devices"]
    assert "this process has 4" in refused["tp 8 of 4 devices"]
    assert "num_key_value_heads=2" in refused["tp 4 over 2 kv heads"]
    assert "num_attention_heads" not in refused["tp 4 over 2 kv heads"]
    assert "has no experts" in refused["ep without experts"]
    assert "n_routed_experts=4" in refused["ep 3 over 4 experts"]
    assert "num_attention_heads=4" in refused["ep 3 over 4 experts"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_hosts(checkpoint: str, shifts: tuple[int, int]) -> list[dict]:
    """Two processes of one engine, 2 CPU devices each, tensor_parallel_size=4 (a 2 x 2 mesh)."""
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "host", checkpoint, "4", str(shifts[i])],
            env=_env(
                2,
                JAX_COORDINATOR_ADDRESS=address,
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-4000:]
            outs.append(_last_json(stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(outs, key=lambda o: o["process"])


def test_two_processes_give_one_process_tokens(checkpoints, results):
    hosts = _two_hosts(checkpoints["llama"], (0, 0))
    assert [h["devices"] for h in hosts] == [4, 4]
    one = results["engines"]["llama tp=1"]["tokens"]
    assert [h.get("tokens") for h in hosts] == [one, one], hosts


def test_a_diverging_process_is_named_in_every_process(checkpoints):
    hosts = _two_hosts(checkpoints["llama"], (0, 1))
    for h in hosts:
        error = h.get("error", "")
        assert error.startswith("ProcessesDiverged: step 0:"), h
        assert "new requests: process 0 " in error and ", process 1 " in error, error
        # Same prompt lengths: only the prompts' tokens differ, not the schedule's sizes.
        assert "scheduled tokens" not in error, error

"""Multi-host engines: one process per host, all running the same engine on the same inputs.

Every process of a `jax.distributed` group builds the same LLM and is given the same prompts; each
runs the pure scheduler itself, so the schedules agree without being sent anywhere, and the jitted
step runs as one SPMD program over the group's mesh (runtime/runner/parallel.py). What must never
happen is two processes stepping different schedules: their device programs would then wait on
each other's collectives forever. So once per step, before the device step, every process
all-gathers digests of its scheduler output's fields (`check_agreement`), and a disagreement raises
`ProcessesDiverged` in every process at once, naming the step, the fields that differ and each
process's digest of them.

`initialize` starts the group from arguments or from JAX's environment variables
(JAX_COORDINATOR_ADDRESS, and here also JAX_NUM_PROCESSES and JAX_PROCESS_ID); `LLM()` calls it
when JAX_COORDINATOR_ADDRESS is set.
"""

from __future__ import annotations

import hashlib
import logging
import os

import jax
import numpy as np

from runtime.core.outputs import SchedulerOutput

log = logging.getLogger(__name__)


class ProcessesDiverged(RuntimeError):
    """The processes of a multi-host engine scheduled different steps."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize` from the arguments, else from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; nothing if this process already joined a group."""
    if jax.distributed.is_initialized():
        return
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    count = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    index = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    missing = [
        name
        for name, value in (
            ("coordinator_address / JAX_COORDINATOR_ADDRESS", address),
            ("num_processes / JAX_NUM_PROCESSES", count),
            ("process_id / JAX_PROCESS_ID", index),
        )
        if value is None
    ]
    if missing:
        raise ValueError(f"a multi-host engine needs {', '.join(missing)}")
    if not 0 <= index < count:
        raise ValueError(f"process_id={index} must be in [0, num_processes={count})")
    jax.distributed.initialize(address, num_processes=count, process_id=index)
    log.info(
        "process %d of %d joined the group at %s: %d local devices of %d",
        index,
        count,
        address,
        jax.local_device_count(),
        jax.device_count(),
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def step_fields(out: SchedulerOutput) -> dict[str, bytes]:
    """The scheduler output as named byte strings, in an order that does not depend on the
    process (no map iteration order, no Python hash)."""
    return {
        "step": str(out.step).encode(),
        "scheduled tokens": repr(sorted(out.num_scheduled_tokens.items())).encode(),
        "new requests": repr(
            [
                (r.req_id, r.prompt_token_ids, r.block_ids, r.num_computed_tokens)
                for r in out.scheduled_new_reqs
            ]
        ).encode(),
        "running requests": repr(
            [
                (r.req_id, r.new_block_ids, r.num_computed_tokens, r.resumed_from_preemption)
                for r in out.scheduled_cached_reqs
            ]
        ).encode(),
        "preempted": repr(sorted(out.preempted_req_ids)).encode(),
        "finished": repr(sorted(out.finished_req_ids)).encode(),
    }


def _digest(data: bytes) -> np.int32:
    # 32 bits: JAX (without x64) gathers int32; a chance collision is 1 in 4e9 per field and step.
    return np.frombuffer(hashlib.blake2b(data, digest_size=4).digest(), np.int32)[0]


def check_agreement(out: SchedulerOutput) -> None:
    """Every process has the same scheduler output for this step, or ProcessesDiverged in all of
    them. One all-gather of a few int32 digests; nothing to do in a one-process group."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    fields = step_fields(out)
    mine = np.array([_digest(v) for v in fields.values()], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, fields]
    differ = [i for i in range(len(fields)) if len(set(every[:, i].tolist())) > 1]
    if not differ:
        return
    names = list(fields)
    detail = "; ".join(
        f"{names[i]}: "
        + ", ".join(f"process {p} {int(every[p, i]) & 0xFFFFFFFF:08x}" for p in range(len(every)))
        for i in differ
    )
    raise ProcessesDiverged(
        f"step {out.step}: the processes of this multi-host engine scheduled different steps "
        f"(this is process {jax.process_index()} of {jax.process_count()}); fields that differ: "
        f"{detail}. Every process must be given the same prompts, parameters and engine "
        "arguments, in the same order."
    )

"""FSDP2 and tensor parallelism on CPU processes (gloo), so their code paths run in CI and in `make preflight`
without GPUs.

Why an adapter: accelerate turns `distributed_type: FSDP` into its FSDP branch only when the launched
processes are of a GPU-type distributed type (MULTI_GPU, MULTI_XPU, ...). CPU processes are MULTI_CPU, so
the FSDP plugin would be silently ignored and the run would be plain DDP. torch's `fully_shard`, DTensor
and DCP checkpoints themselves work on CPU over gloo.

What it does: it creates accelerate's process state on CPU first (gloo, CPU device), then presents that
state as MULTI_GPU for the one check in AcceleratorState that selects the FSDP branch; accelerate then
records FSDP on the shared state, exactly as on GPUs. Devices and the backend stay CPU/gloo throughout.
It is only used when no accelerator is present and the launcher asked for FSDP (see backends.py).
Tensor parallelism: accelerate accepts a ParallelismConfig only on GPU-type (or FSDP2, DeepSpeed) processes,
in one check while the Accelerator is built; the mesh, DTensors and their collectives work on CPU over gloo.
The same presentation as MULTI_GPU for that check, then the state is MULTI_CPU again.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta


@contextmanager
def fsdp_branch_on_cpu(timeout: timedelta):
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True, timeout=timeout)
    if state.distributed_type != DistributedType.MULTI_CPU:  # single process: nothing to shard
        yield
        return
    state.distributed_type = DistributedType.MULTI_GPU
    try:
        yield  # Accelerator(...) is built here; accelerate then records FSDP on both shared states
    except BaseException:
        state.distributed_type = DistributedType.MULTI_CPU
        raise
    if state.distributed_type != DistributedType.FSDP:
        raise RuntimeError("FSDP-on-CPU adapter: accelerate did not take its FSDP branch "
                           f"(state is {state.distributed_type}); this accelerate version needs a new adapter")


@contextmanager
def tensor_parallel_on_cpu(timeout: timedelta):
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True, timeout=timeout)
    state.distributed_type = DistributedType.MULTI_GPU
    try:
        yield  # Accelerator(...) is built here and checks its ParallelismConfig against this type
    finally:
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):  # it copied the type
            if "distributed_type" in shared:
                shared["distributed_type"] = DistributedType.MULTI_CPU


def unpin_offload(accelerator) -> None:
    """fsdp_offload on CPU: keep the offload policy (its code path is what we test) but without pinned
    memory, which needs an accelerator to exist."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = accelerator.state.fsdp_plugin
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)

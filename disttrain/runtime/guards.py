"""Runtime guards: turn the silent ways a distributed run goes wrong into one clear line.

- Where am I: the run records its current phase and step (`at(...)`, a dict write, nothing more), so that a
  collective that times out or loses a peer is reported as "rank R, step S, <phase>" instead of a C++
  stack trace, and a stall is announced before the process-group timeout kills the job.
- Replica consistency: a float64 checksum of the parameters, compared across ranks before wrapping (catches
  ranks that built different initial weights) and every N steps while the weights are replicated
  (DDP, ZeRO-1/2), where the copies must stay bit-identical.
- Loss spread: the per-rank losses of a log window are compared and a warning names the extreme ranks.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager

import torch

from disttrain.errors import DisttrainError

TROUBLESHOOTING = "docs/troubleshooting.md"

_where = {"phase": "starting up", "step": 0, "since": time.monotonic()}
_timeout_s = 1800.0


class CollectiveFailure(DisttrainError):
    """A collective timed out or lost a peer: the run cannot continue."""

    exit_code = 3


class ReplicaMismatch(DisttrainError):
    exit_code = 4


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _world() -> str:
    return os.environ.get("WORLD_SIZE", "1")


def at(phase: str, step: int | None = None, collective: bool = True) -> None:
    """Record what this rank is doing now (called at every phase change; costs a dict update). `collective`:
    False for a phase that waits outside any collective (the scoring: its wait is evaluation.wait_s, not the
    process-group timeout), which the stall watch then does not warn about."""
    if phase != _where["phase"] or (step is not None and step != _where["step"]):
        _where["since"] = time.monotonic()
    _where["phase"] = phase
    _where["collective"] = collective
    if step is not None:
        _where["step"] = step


def where() -> str:
    return f"'{_where['phase']}' at step {_where['step']}"


# ----------------------------------------------------------------------------- collective failures
_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
_CONNECT = re.compile(r"connectFullMesh failed|Connection refused", re.IGNORECASE)
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|ECONNRESET|"
                        r"remote process exited|NCCL communicator was aborted", re.IGNORECASE)


def describe_collective_error(exc: BaseException) -> str | None:
    """One line for a timeout / lost peer raised by a collective; None for any other exception."""
    text = str(exc)
    # Only errors of the distributed stack: a Hub download timeout (an OSError) is not a collective.
    from_collective = isinstance(exc, getattr(torch.distributed, "DistError", ())) or (
        isinstance(exc, RuntimeError) and _BACKEND.search(text) is not None)
    if isinstance(exc, DisttrainError) or not from_collective:
        return None
    if _CONNECT.search(text) and restarted_on_shared_store():
        return (f"rank {_rank()} of {_world()}: could not connect to another rank in {where()} after torchrun "
                f"restarted the workers (restart {os.environ['TORCHELASTIC_RESTART_COUNT']}): with the shared "
                "rendezvous store the new workers can read the dead workers' addresses (pytorch/pytorch#135712). "
                f"Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (make ... MAX_RESTARTS=N sets it). "
                f"See {TROUBLESHOOTING}#elastic-shared-store")
    if _CONNECT.search(text):
        return (f"rank {_rank()} of {_world()}: could not connect to another rank in {where()}: that rank died "
                "during start-up, or (several nodes) a firewall blocks the ports between nodes / the wrong network "
                "interface is used (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME). `make doctor` checks both. "
                f"See {TROUBLESHOOTING}#rank-died")
    if _TIMEOUT.search(text):
        return (f"rank {_rank()} of {_world()}: a collective timed out after {_timeout_s:g}s in {where()}: "
                "another rank did not join it (hung, stopped, crashed, or busier than distributed.timeout_s). "
                "Find the first error in the other ranks' output (`make diagnose LOG=<log>`); if a rank was "
                "legitimately busy (tokenising a large dataset, a slow checkpoint write), raise "
                f"distributed.timeout_s. See {TROUBLESHOOTING}#collective-timeout")
    if _PEER_LOST.search(text):
        return (f"rank {_rank()} of {_world()}: lost the connection to another rank in {where()}: that rank "
                "died first. Its own output names the cause (killed by the OOM killer = exit -9, a Python "
                f"error, an abort); `make diagnose LOG=<log>` finds it. See {TROUBLESHOOTING}#rank-died")
    return None


def _elastic_shared_store() -> bool:
    """torchrun may restart the workers (--max_restarts > 0) and they share the agent's rendezvous store."""
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def restarted_on_shared_store() -> bool:
    return _elastic_shared_store() and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def warn_elastic_shared_store() -> None:
    """Before the first rendezvous: restarts on the shared store fail more often than not (measured here on
    CPU/gloo, one rank SIGKILLed: the restart recovered in 5 of 12 tries with it, 12 of 12 without it)."""
    if _elastic_shared_store() and int(os.environ.get("RANK", "0")) == 0:
        print("warning: torchrun restarts are enabled (--max_restarts) with the shared rendezvous store: "
              "restarted workers may connect to the dead workers' addresses and fail (pytorch/pytorch#135712). "
              "Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (make ... MAX_RESTARTS=N sets it). "
              f"See {TROUBLESHOOTING}#elastic-shared-store", file=sys.stderr, flush=True)


def warn_short_shutdown_timeout() -> None:
    """A preemption SIGTERM reaches the launcher, whose torchrun agent forwards it to the workers and SIGKILLs
    them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default): too short for a large checkpoint."""
    launched_by_agent = "TORCHELASTIC_RUN_ID" in os.environ
    configured = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or os.environ.get("PET_SHUTDOWN_TIMEOUT")
    if launched_by_agent and not configured and int(os.environ.get("RANK", "0")) == 0:
        print("note: on SIGTERM (preemption, scancel) the launcher gives the workers 30 s to checkpoint before "
              "it kills them; a large checkpoint needs longer: launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 "
              f"(make train-* sets it). See {TROUBLESHOOTING}#preemption-checkpoint-cut-off",
              file=sys.stderr, flush=True)


@contextmanager
def collective_failures_explained():
    """Re-raise a collective timeout / lost peer as one user-facing line (the traceback says nothing more)."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        message = describe_collective_error(exc)
        if message is None:
            raise
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise CollectiveFailure(f"{message} (cause: {type(exc).__name__}: {cause})") from None


def watch(timeout_s: float, check_every_s: float | None = None) -> None:
    """Remember the process-group timeout and start a daemon thread that says, once per phase, when this
    rank has been stuck for 80 % of it. With NCCL the watchdog then aborts the process from C++ without
    naming our phase or step; this line names them first. A rank that dies in native code (SIGSEGV, SIGABRT)
    prints every thread's Python stack first (faulthandler), where torchrun's summary gives only the signal."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    global _timeout_s
    _timeout_s = float(timeout_s)
    interval = check_every_s or max(0.2, min(10.0, timeout_s / 20))

    def run():
        warned_for = None
        while True:
            time.sleep(interval)
            key = (_where["phase"], _where["step"], _where["since"])
            stuck = time.monotonic() - _where["since"]
            if key != warned_for and stuck > 0.8 * _timeout_s and _where.get("collective", True):
                print(f"warning: rank {_rank()}: no progress for {stuck:.0f}s in {where()}; collectives time out "
                      f"after {_timeout_s:g}s (distributed.timeout_s)", file=sys.stderr, flush=True)
                warned_for = key

    threading.Thread(target=run, name="disttrain-stall-watch", daemon=True).start()


_held: list = []


def hold_until_exit(*objects) -> None:
    """Keep what owns the process groups (the prepared model and optimizer, the accelerator) alive until
    train.py ends the process with os._exit, instead of letting them go when main() returns. Freed there, the
    last reference to a gloo process group runs ~ProcessGroupGloo with the GIL held; it joins gloo's work
    thread, which may still be releasing the last collective's tensors and needs the GIL for that: the rank
    then hangs forever after a complete run (seen: one of the test suite's ~200 launches, 4 of 68 on a loaded
    machine; main thread in ~ProcessGroupGloo <- ~Reducer, gloo's thread in take_gil; pytorch#56297). The
    bench's raw DDP loop and commbench hold theirs the same way (tests/test_guards.py checks each one)."""
    _held.extend(objects)


# ----------------------------------------------------------------------------- replica consistency
def replicated_parameters(model) -> list[torch.Tensor]:
    """The parameters every rank holds whole, which must stay bit-identical across ranks: all of them under DDP
    and ZeRO-1/2; under tensor parallelism the ones transformers leaves unsplit (plain tensors: peft's lora_A on
    column-split layers, which nothing all-reduces, so one rank's own dropout mask would make them drift); none
    under FSDP and ZeRO-3 (shards, meta tensors), nor on a pipeline's stage (each process its own layers)."""
    return [p for _, p in _named_replicated(model)]


def _named_replicated(model) -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    if getattr(getattr(model, "module", model), "_disttrain_stage", None) is not None:
        return []  # parallel/pipeline.py: a stage's weights live on its processes only (FSDP2-sharded over them)
    return [(name, p) for name, p in model.named_parameters()
            if not (p.is_meta or hasattr(p, "ds_id") or isinstance(p, DTensor) or isinstance(p.data, DTensor))]


def parameter_checksum(parameters, device) -> torch.Tensor:
    """[sum, sum of squares, numel] over `parameters` in float64, chunked so that a large embedding is
    never copied whole. Bit-identical replicas give bit-identical checksums."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for p in parameters:
        for chunk in p.detach().reshape(-1).split(1 << 24):
            chunk = chunk.to(device)
            sums[0] += chunk.sum(dtype=torch.float64)
            sums[1] += chunk.float().square().sum(dtype=torch.float64)
        sums[2] += p.numel()
    return sums


def compare_replicas(accelerator, model) -> list[int] | None:
    """Ranks whose replicated weights differ from rank 0's; None when no weight is replicated (nothing compared)."""
    if accelerator.num_processes == 1:
        return None
    replicated = replicated_parameters(model)
    any_replicated = torch.tensor([float(bool(replicated))], device=accelerator.device)
    if not bool((accelerator.gather(any_replicated) == 1).all()):  # cheap: no rank sums what it cannot compare
        return None
    per_rank = accelerator.gather(parameter_checksum(replicated, accelerator.device).unsqueeze(0)).reshape(-1, 3).cpu()
    return [rank for rank in range(per_rank.shape[0])
            if not torch.allclose(per_rank[rank], per_rank[0], rtol=1e-12, atol=0.0)]


def check_initial_replicas(accelerator, model) -> None:
    """Before wrapping: every rank must have built the same weights (same seed, same checkpoint)."""
    at("checking that all ranks built the same initial weights")
    differing = compare_replicas(accelerator, model)
    if differing:
        accelerator.print(
            f"warning: ranks {differing} built different initial weights than rank 0 (a seed set per rank "
            "before the model or LoRA init, or a different model revision on some node). DDP / DeepSpeed / "
            "FSDP continue from rank 0's copy, but anything else seeded per rank is suspect. See "
            f"{TROUBLESHOOTING}#loss-spread")


def divergence_details(accelerator, model) -> str:
    """Where replicas differ, for the error line (every rank calls it: two gathers): the first replicated parameter
    (in the model's order) whose checksum differs on some rank, and the ranks whose random generator is in rank
    0's state now. Ranks of one tensor-parallel group draw one stream: if they are listed, their draws agreed and
    the arithmetic differed; if not, a draw happened on one of them only."""
    import hashlib

    named = _named_replicated(accelerator.unwrap_model(model))  # the model's own names, not DDP's module.*
    sums = torch.stack([parameter_checksum([p], accelerator.device)[:2] for _, p in named])
    per_rank = accelerator.gather(sums.unsqueeze(0)).reshape(-1, len(named), 2).cpu()
    first = next((name for i, (name, _) in enumerate(named)
                  if not all(torch.equal(per_rank[r, i], per_rank[0, i]) for r in range(per_rank.shape[0]))), "?")
    state = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    digests = accelerator.gather(torch.tensor([int(state[:12], 16)], device=accelerator.device)).cpu().tolist()
    same = [rank for rank in range(1, len(digests)) if digests[rank] == digests[0]]
    return f"first differing parameter: {first}; random generator in rank 0's state on ranks {same}"


def check_replicas(accelerator, model, step: int, last_checkpoint=None) -> None:
    """Replicated weights (DDP, ZeRO-1/2, the unsplit ones under TP) must stay bit-identical across ranks."""
    at("comparing parameter checksums across ranks", step)
    differing = compare_replicas(accelerator, model)
    if differing:
        details = divergence_details(accelerator, model)
        resume = f"; newest checkpoint of this run (rank 0's weights): {last_checkpoint}" if last_checkpoint else ""
        raise ReplicaMismatch(
            f"step {step}: the weights on ranks {differing} differ from rank 0's although they are replicated "
            "copies: the ranks diverged (a rank skipped or repeated an optimizer step, a parameter that is "
            "not synchronised, or non-deterministic code that runs on one rank only; "
            f"{details}). Training further would waste compute{resume}. See {TROUBLESHOOTING}#replica-mismatch")


# ----------------------------------------------------------------------------- loss spread
class LossSpreadWarning:
    """Warns when the per-rank losses of a log window differ by more than `threshold` (relative to the
    mean loss); repeats at most every `quiet_steps` steps."""

    def __init__(self, threshold: float | None, quiet_steps: int = 100):
        self.threshold, self.quiet_steps, self.last_warned = threshold, quiet_steps, None

    def __call__(self, record: dict, step: int, print_fn) -> None:
        if not self.threshold or "loss_rank_spread" not in record:
            return
        if record["loss_rank_spread"] <= self.threshold:
            return
        if self.last_warned is not None and step - self.last_warned < self.quiet_steps:
            return
        self.last_warned = step
        print_fn(f"warning: step {step}: loss differs across ranks by {record['loss_rank_spread']:.0%} of the mean "
                 f"(rank {record['loss_rank_max_rank']}: {record['loss_rank_max']:.4g}, rank "
                 f"{record['loss_rank_min_rank']}: {record['loss_rank_min']:.4g}; distributed.loss_spread_warning="
                 f"{self.threshold:g}): ranks see differently distributed data or have diverged. See "
                 f"{TROUBLESHOOTING}#loss-spread")

"""Checkpoints that survive crashes, and exact resume.

Layout under `<output.dir>/checkpoints/`:
    step-00000120/          accelerate.save_state(): model + optimizer (sharded for FSDP/ZeRO; DCP shards in
                            tp_state/ under tensor parallelism: accelerator_state.py), scheduler,
                            per-rank RNG, plus trainer_state.json and manifest.json (written last)
    latest                  name of the newest complete checkpoint
    .tmp-step-00000130/     a save in progress (or killed mid-way): never picked for resume

Atomicity: every rank writes into the .tmp dir; after a barrier the main process writes the manifest
(file list and sizes), renames the dir into place and then rewrites `latest` (write + rename). A crash at
any point leaves the previous checkpoint and marker intact. On resume the manifest is checked, so a
truncated or damaged checkpoint is named in one line instead of being loaded.

Data position needs no sampler state: every epoch has exactly `steps_per_epoch` windows of `grad_accum`
micro-batches from the seeded permutation of that epoch, so step k means epoch k // steps_per_epoch with
(k % steps_per_epoch) * grad_accum micro-batches consumed, skipped with accelerator.skip_first_batches.
A stream (data.streaming) has no such arithmetic: each rank writes its stream position to
`data_state/rank-NNNNN.json` in the checkpoint and reads it back on resume (same world size required).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from disttrain.errors import DisttrainError
from disttrain.training import accelerator_state

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
DATA_STATE = "data_state"
SAVE_ORDER = "save_order"  # key in trainer_state.json: 1 + the highest order in the directory at save time
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(DisttrainError):
    pass


@dataclass
class RunShape:
    """What must match (or be converted) to resume a checkpoint."""

    world_size: int
    strategy: str
    micro_batch_size: int
    grad_accum: int
    streaming: bool = False  # per-rank stream positions: resumable only by the same number of ranks
    zero_stage: int | None = None  # DeepSpeed: another stage's optimizer/weight shards do not load
    mesh: str | None = None  # "dp_replicate=R,dp_shard=S" (HSDP), "dp_shard=D,sp=S" (Ulysses); None: one dimension

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accum

    @classmethod
    def of(cls, plan, training, streaming: bool) -> RunShape:
        """This launch's shape, from its parallel plan (parallel/plan.py) and the recipe's training section."""
        return cls(plan.processes, plan.checkpoint_strategy, training.micro_batch_size, training.grad_accum,
                   streaming, plan.zero_stage, plan.mesh)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _files_with_sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rank_state_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / DATA_STATE / f"rank-{rank:05d}.json"


def load_rank_state(checkpoint: Path, rank: int) -> dict:
    """This rank's step-source state saved in `checkpoint` (a stream's position, online RL's completions)."""
    path = _rank_state_file(checkpoint, rank)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} holds no data state for rank {rank} ({path} is missing): it "
                              "was not written by a run of this kind and size (a streaming run's position, or online "
                              "RL's completions with rl.num_iterations > 1)")
    return json.loads(path.read_text())


def restore(accelerator, checkpoint: Path, saved_state: dict, train_state, steps) -> None:
    """Resume in one call, what `save` wrote: weights, optimizer, schedule and RNG (accelerate's state, or DCP
    under TP), the train state (`saved_state`, read and matched by resume_point), and the step source's own state
    where it keeps one (a stream's position, per rank; online RL's completions between two iterations; a
    map-style feed's position follows from the step)."""
    accelerator_state.load_state(accelerator, checkpoint)
    train_state.load_state_dict(saved_state)
    if steps.rank_state is not None:
        steps.restore(load_rank_state(checkpoint, accelerator.process_index))


def save(accelerator, output_dir: str | Path, train_state, shape: RunShape, keep_last: int,
         rank_state: dict | None = None) -> Path:
    """Collective: every rank must call it at the same step. `rank_state`: this rank's own data position
    (a stream's), written by each rank next to the shared state."""
    root = checkpoint_root(output_dir)
    name = f"step-{train_state.step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed at this very step
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator_state.save_state(accelerator, tmp)
        if rank_state is not None:
            path = _rank_state_file(tmp, accelerator.process_index)
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(rank_state))
        accelerator.wait_for_everyone()  # all shards are on disk before anything is declared complete
        if accelerator.is_main_process:
            order = max((_save_order(p)[0] for p in _complete(root)), default=0) + 1
            (tmp / TRAINER_STATE).write_text(json.dumps({**train_state.state_dict(), "shape": asdict(shape),
                                                         SAVE_ORDER: order}, indent=1))
            (tmp / MANIFEST).write_text(json.dumps({"files": _files_with_sizes(tmp)}, indent=1))
            if final.exists():  # same step saved before (e.g. resumed and stopped again at once)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomically(root / LATEST, name)
            _prune(root, keep_last, final)
    except Exception as exc:  # OSError, torch's RuntimeError, safetensors' SafetensorError
        if not _out_of_space(exc, root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save: never used, and it holds the space
        intact = find(output_dir, "auto")
        raise CheckpointError(
            f"no space left on {root} while writing the checkpoint of step {train_state.step}: "
            + (f"{intact.name} is intact and a rerun resumes from it" if intact else "no earlier checkpoint exists")
            + f"; a save needs room for one more checkpoint (about {_size_of(intact)}) beside the {keep_last} kept: "
            + ("free space there" if keep_last <= 1 else "free space there or lower output.keep_last")) from None
    accelerator.wait_for_everyone()
    return final


LOW_SPACE = 64 * 2**20  # bytes: below this a failed write is taken for a full disk


def _out_of_space(exc: BaseException, root: Path) -> bool:
    """Whether a failed write ran out of disk: ENOSPC anywhere in the chain, or a full disk after torch's C++
    writers failed (they say `basic_ios::clear: iostream error` or `inline_container.cc ... file write
    failed`, without the errno)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    try:
        return shutil.disk_usage(root).free < LOW_SPACE
    except OSError:
        return False


def _size_of(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "as much as the model and optimizer states"
    return _human(sum(_files_with_sizes(checkpoint).values()))


def _human(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def warn_if_short_of_space(accelerator, output_dir: str | Path, expected_bytes: int) -> None:
    """Before the first save: a warning when the disk holding output.dir has less free space than one
    checkpoint of this run is expected to take."""
    root = checkpoint_root(output_dir)
    probe = next((p for p in (root, *root.parents) if p.exists()), None)
    free = shutil.disk_usage(probe).free if probe else None
    if free is not None and free < expected_bytes:
        accelerator.print(f"WARNING: checkpoint: {_human(free)} free on the disk of {root}, a checkpoint of this run "
                          f"takes about {_human(expected_bytes)} (weights and optimizer states): free space, or the "
                          "run will stop at its first save")


def expected_bytes(model) -> int:
    """About one checkpoint's size: every weight in its dtype, and for each trainable one Adam's two fp32
    moments plus, where the weights are not fp32, the fp32 master copy (DeepSpeed, FSDP mixed precision)."""
    total = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions hold 0 elements locally
        total += numel * p.element_size()
        if p.requires_grad:
            total += numel * (8 + (4 if p.element_size() < 4 else 0))
    return total


def _complete(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=lambda p: p.name)


def _save_order(checkpoint: Path) -> tuple[int, int]:
    """(save order, step): the order checkpoints were written in, which is not the step order once a run
    resumes from an older checkpoint in a directory that still holds later ones."""
    try:
        order = json.loads((checkpoint / TRAINER_STATE).read_text()).get(SAVE_ORDER, 0)
    except (OSError, json.JSONDecodeError):
        order = 0
    return order, int(_NAME.match(checkpoint.name).group(1))


def _prune(root: Path, keep_last: int, just_written: Path) -> None:
    """Keep the `keep_last` most recently written checkpoints; never the one just written."""
    older = sorted((p for p in _complete(root) if p != just_written), key=_save_order)
    for old in older[:max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def verify(checkpoint: Path) -> None:
    """One-line error if files are missing, truncated or extended since the save."""
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} is incomplete (no {MANIFEST}): it was not written by a "
                              "finished save; delete it or resume from another one")
    try:
        expected = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError):
        raise CheckpointError(f"checkpoint {checkpoint}: {MANIFEST} is damaged; "
                              "resume from another checkpoint") from None
    actual = _files_with_sizes(checkpoint)
    actual.pop(MANIFEST, None)
    for rel, size in expected.items():
        if rel not in actual:
            raise CheckpointError(f"checkpoint {checkpoint} is corrupt: {rel} is missing")
        if actual[rel] != size:
            raise CheckpointError(f"checkpoint {checkpoint} is corrupt: {rel} has {actual[rel]} bytes, "
                                  f"{size} were written")


def find(output_dir: str | Path, resume: str) -> Path | None:
    """`auto`: newest complete checkpoint in the output dir (None if there is none); `none`; or a path."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"output.resume={resume!r}: no such checkpoint directory")
        return path
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip()).is_dir():
        return root / latest.read_text().strip()
    candidates = _complete(root)
    return candidates[-1] if candidates else None


def check_fresh_start(output_dir: str | Path, resume: str) -> None:
    """output.resume=none in a directory that holds another run's checkpoints: the new run's checkpoints would
    be pruned and resumed among the old ones, so a later auto-resume could pick up the other run's state."""
    root = checkpoint_root(output_dir)
    existing = _complete(root) if resume == "none" and root.is_dir() else []
    if existing:
        raise CheckpointError(f"output.dir={output_dir} already holds checkpoints of an earlier run (newest: "
                              f"{existing[-1].name}) and output.resume=none starts a new one: use a new output.dir, "
                              f"delete {root}, or continue the earlier run with output.resume=auto")


def _mesh_name(shape: RunShape) -> str:
    return f"the mesh {shape.mesh}" if shape.mesh else "one dimension (no parallelism_config)"


def check_shape(checkpoint: Path, current: RunShape) -> dict:
    """Returns the saved trainer state; raises one line when the checkpoint cannot continue this run."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    state.pop(SAVE_ORDER, None)
    saved = RunShape(**state.pop("shape"))
    if saved.streaming != current.streaming:
        raise CheckpointError(f"checkpoint {checkpoint} was written with data.streaming={saved.streaming}, this run "
                              f"has data.streaming={current.streaming}: the data position of one cannot continue "
                              f"the other; set data.streaming={saved.streaming} or use a new output.dir")
    if saved.streaming and saved.world_size != current.world_size:
        raise CheckpointError(f"checkpoint {checkpoint} holds the stream positions of {saved.world_size} ranks, this "
                              f"run has {current.world_size}: each rank reads its own share of the stream, so a "
                              f"streaming run resumes with the same number of processes ({saved.world_size})")
    if saved.strategy != current.strategy:
        run_dir = checkpoint.parent.parent
        raise CheckpointError(f"checkpoint {checkpoint} was written under {saved.strategy}, this run is "
                              f"{current.strategy}: continue that run with its own accelerate config "
                              f"({saved.strategy}), or train under {current.strategy} in a new directory "
                              f"(output.dir={run_dir}-{current.strategy}, or put {{strategy}} in output.dir as the "
                              "shipped recipes do)")
    if None not in (saved.zero_stage, current.zero_stage) and saved.zero_stage != current.zero_stage:
        run_dir = checkpoint.parent.parent
        raise CheckpointError(f"checkpoint {checkpoint} was written under ZeRO-{saved.zero_stage}, this run is "
                              f"ZeRO-{current.zero_stage}: DeepSpeed cannot load one's shards into the other; continue "
                              f"that run with accelerate_configs/zero{saved.zero_stage}.yaml, or train under "
                              f"ZeRO-{current.zero_stage} in a new directory (output.dir={run_dir}-zero"
                              f"{current.zero_stage}, or put {{strategy}} in output.dir as the shipped recipes do)")
    if saved.mesh != current.mesh:
        raise CheckpointError(f"checkpoint {checkpoint} was written on {_mesh_name(saved)}, this run is on "
                              f"{_mesh_name(current)}: resume it on the mesh it was written on (the same "
                              "parallelism_config sizes), or train on this mesh in a new output.dir")
    if saved.world_size != current.world_size and current.strategy == "deepspeed":
        # DeepSpeed copies its conversion script next to the tag dir (accelerate's tag: pytorch_model/)
        script = next(iter(sorted(checkpoint.rglob("zero_to_fp32.py"))), None)
        export = f"python {script} {checkpoint} <out dir>" if script else "DeepSpeed's zero_to_fp32.py"
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by {saved.world_size} processes, this run has "
            f"{current.world_size}: DeepSpeed ZeRO shards are per rank; convert it with "
            f"`python -m deepspeed.checkpoint.ds_to_universal` (universal checkpoint) or export weights with "
            f"`{export}`, or resume with {saved.world_size} processes")
    if saved.global_batch != current.global_batch:
        # the data position is derived from the step, so the rows per step must not change
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by {saved.world_size} processes with a global batch of "
            f"{saved.global_batch} rows; this run has {current.world_size} processes and "
            f"{current.global_batch}: set training.grad_accum so that processes x micro_batch_size x "
            f"grad_accum = {saved.global_batch}, which keeps the data order and schedule exact")
    return state


def resume_point(output, shape: RunShape) -> tuple[Path | None, dict | None]:
    """The checkpoint this launch resumes from (output.resume: auto / a dir / none) and its train state,
    verified and matched against this launch's shape before any model is loaded; (None, None) to start."""
    check_fresh_start(output.dir, output.resume)  # never mix two runs' checkpoints
    found = find(output.dir, output.resume)
    if found is None:
        return None, None
    verify(found)
    return found, check_shape(found, shape)


class Checkpointer:
    """What the loop needs: when to save, and how. Saves come every `every` optimizer steps, every `minutes` of
    wall-clock time since the loop started or last saved (so a crash loses at most that much), and at the end."""

    def __init__(self, accelerator, output_dir: str | Path, every: int | None, at_end: bool, keep_last: int,
                 shape: RunShape, rank_state=None, expected_bytes: int | None = None, minutes: float | None = None,
                 clock=time.monotonic):
        self.accelerator, self.output_dir, self.every, self.at_end = accelerator, output_dir, every, at_end
        self.keep_last, self.shape, self.minutes, self.clock = keep_last, shape, minutes, clock
        self.rank_state = rank_state  # () -> this rank's data position, or None (map-style data)
        self.last_saved: Path | None = None
        self.since = clock()
        if expected_bytes and (every or minutes or at_end) and accelerator.is_main_process:
            warn_if_short_of_space(accelerator, output_dir, expected_bytes)

    @classmethod
    def for_output(cls, accelerator, output, shape: RunShape, rank_state=None,
                   expected_bytes: int | None = None) -> Checkpointer:
        """The recipe's output section's cadence (checkpoint_every, checkpoint_minutes, checkpoint_at_end)."""
        return cls(accelerator, output.dir, output.checkpoint_every, output.checkpoint_at_end, output.keep_last, shape,
                   rank_state, expected_bytes, output.checkpoint_minutes)

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every and step % self.every == 0) or (last and self.at_end)

    def time_due(self) -> bool:
        """This rank's clock says a save is due; the loop saves on every rank when any rank's clock says so."""
        return self.minutes is not None and self.clock() - self.since >= self.minutes * 60

    def save(self, train_state) -> Path:
        self.last_saved = save(self.accelerator, self.output_dir, train_state, self.shape, self.keep_last,
                               self.rank_state() if self.rank_state else None)
        self.since = self.clock()
        self.accelerator.print(f"checkpoint: {self.last_saved}")
        return self.last_saved

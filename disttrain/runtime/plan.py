"""The parallel plan: how this launch splits the work, read once from what `accelerate launch` set.

Every process is a data-parallel rank under DDP, FSDP2, HSDP and ZeRO-1/2/3 (they differ in what they shard,
not in who reads which data). Ulysses sequence parallelism (DeepSpeed's ALST on accelerate's
ParallelismConfig, `sp`) groups sp consecutive processes around one sequence: they read the same rows and
each keeps 1/sp of every sequence (data.collation.SequenceShard), so the data rank is process // sp. The rest
of the run asks the plan, never the environment: the strategy and its label for output.dir, the ZeRO stage,
the checkpoint's strategy and mesh, which data rank this process is and how many there are (the feed shards
by them), which slice of each sequence it keeps. Token counts and losses are reduced over every process: each
counts only its own slice, and every strategy here averages gradients over all processes (ZeRO-3 under
Ulysses reduces over dp x sp). Tensor and context parallel meshes are refused until they plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.errors import DisttrainError
from disttrain.runtime.backends import launcher_strategy, mesh_sizes, run_label, world_size, zero_stage


@dataclass(frozen=True)
class ParallelPlan:
    strategy: str  # single, ddp, fsdp, deepspeed (what accelerate launched)
    label: str  # output.dir's {strategy}, as the config files are named: ddp, fsdp_offload, zero3, ...
    zero_stage: int | None  # DeepSpeed only
    processes: int
    mesh: str | None = None  # "dp_replicate=R,dp_shard=S" (HSDP) or "dp_shard=D,sp=S" (Ulysses)
    sp: int = 1  # processes that share each sequence, each keeping 1/sp of it (Ulysses)

    @classmethod
    def from_launch(cls) -> ParallelPlan:
        mesh, sp = _mesh(launcher_strategy(), world_size())
        return cls(launcher_strategy(), run_label(), zero_stage(), world_size(), mesh, sp)

    @property
    def checkpoint_strategy(self) -> str:
        """The strategy a checkpoint records: one process is DDP-compatible (its files load under DDP)."""
        return "ddp" if self.strategy == "single" else self.strategy

    def data_rank(self, accelerator) -> int:
        """Which share of the data this process reads: the sp processes of a sequence group read the same."""
        return accelerator.process_index // self.sp

    def data_ranks(self, accelerator) -> int:
        return accelerator.num_processes // self.sp

    def sequence_slice(self, accelerator) -> tuple[int, int] | None:
        """(which slice, of how many) of every training sequence this process keeps; None: all of it."""
        return (accelerator.process_index % self.sp, self.sp) if self.sp > 1 else None


def _mesh(strategy: str, processes: int) -> tuple[str | None, int]:
    """The launch's mesh, checked, and its sequence-parallel size: HSDP (replicas x shards) under FSDP2, or
    Ulysses (groups x sp) under DeepSpeed; it must cover every process. Tensor and context parallel ranks share
    a batch in ways the feed and the loss do not handle yet: such a mesh would train on a wrong normalisation,
    so it is refused."""
    sizes = mesh_sizes()
    if sizes is None:
        return None, 1
    unsupported = {dim: sizes[dim] for dim in ("tp", "cp") if sizes[dim] > 1}
    if unsupported:
        raise DisttrainError("parallelism_config: " + ", ".join(f"{d}_size={n}" for d, n in unsupported.items()) +
                             " is not supported yet: disttrain's meshes are dp_replicate x dp_shard (accelerate_"
                             "configs/hsdp.yaml) and Ulysses sp under ZeRO (zero3_ulysses.yaml); set it to 1")
    if sizes["sp"] > 1:
        if strategy != "deepspeed" or sizes["dp_replicate"] > 1:
            raise DisttrainError(f"parallelism_config: sp_size={sizes['sp']} needs DeepSpeed without "
                                 "dp_replicate (Ulysses is DeepSpeed's); use accelerate_configs/zero3_ulysses.yaml")
        if sizes["dp_shard"] * sizes["sp"] != processes:
            raise DisttrainError(f"parallelism_config: dp_shard_size={sizes['dp_shard']} x sp_size={sizes['sp']} "
                                 f"must equal the {processes} processes launched; set --parallelism_config_dp_"
                                 "shard_size to processes / sp_size (make train-zero3-ulysses SP=... does)")
        return f"dp_shard={sizes['dp_shard']},sp={sizes['sp']}", sizes["sp"]
    if sizes["dp_replicate"] * sizes["dp_shard"] != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={sizes['dp_replicate']} x dp_shard_size="
                             f"{sizes['dp_shard']} must equal the {processes} processes launched; set "
                             "--parallelism_config_dp_replicate_size to the nodes and --parallelism_config_"
                             "dp_shard_size to the GPUs per node (make train-hsdp does)")
    return f"dp_replicate={sizes['dp_replicate']},dp_shard={sizes['dp_shard']}", 1

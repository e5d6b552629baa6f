"""The parallel plan: how this launch splits the work, read once from what `accelerate launch` set.

Every process is a data-parallel rank today (DDP, FSDP2 and ZeRO-1/2/3 differ in what they shard, not in who
reads which data), on one dimension or on HSDP's two (accelerate's ParallelismConfig: dp_replicate x dp_shard,
recorded as `mesh`; any other mesh is refused in one line, see _mesh). The rest of the run asks the plan,
never the environment: the strategy and its label for output.dir, the ZeRO stage, the checkpoint's strategy,
which data rank this process is and how many there are (the data feed shards by them). Token counts and losses
are reduced over every process today (the loop uses the default group). A mesh (long context: context /
sequence / tensor parallel ranks that share a batch) extends this object with its groups; data rank and
process rank then differ, and the feed and the loop ask the plan instead of the accelerator.
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
    mesh: str | None = None  # HSDP: "dp_replicate=R,dp_shard=S" (every process still a data rank)

    @classmethod
    def from_launch(cls) -> ParallelPlan:
        return cls(launcher_strategy(), run_label(), zero_stage(), world_size(), _mesh(world_size()))

    @property
    def checkpoint_strategy(self) -> str:
        """The strategy a checkpoint records: one process is DDP-compatible (its files load under DDP)."""
        return "ddp" if self.strategy == "single" else self.strategy

    @staticmethod
    def data_rank(accelerator) -> int:
        """Which share of the data this process reads: every process is a data rank today."""
        return accelerator.process_index

    @staticmethod
    def data_ranks(accelerator) -> int:
        return accelerator.num_processes


def _mesh(processes: int) -> str | None:
    """The launch's mesh, checked: HSDP (replicas x shards) only, and it must cover every process. Tensor,
    context and sequence parallel ranks share a batch, which the loop's token counts and the data feed do not
    know yet: such a mesh would train on a wrong normalisation, so it is refused."""
    sizes = mesh_sizes()
    if sizes is None:
        return None
    shared = {dim: n for dim, n in sizes.items() if dim not in ("dp_replicate", "dp_shard") and n > 1}
    if shared:
        raise DisttrainError("parallelism_config: " + ", ".join(f"{d}_size={n}" for d, n in shared.items()) +
                             " is not supported yet: disttrain's meshes are data-parallel only (dp_replicate x "
                             "dp_shard, accelerate_configs/hsdp.yaml); set those sizes to 1")
    if sizes["dp_replicate"] * sizes["dp_shard"] != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={sizes['dp_replicate']} x dp_shard_size="
                             f"{sizes['dp_shard']} must equal the {processes} processes launched; set "
                             "--parallelism_config_dp_replicate_size to the nodes and --parallelism_config_"
                             "dp_shard_size to the GPUs per node (make train-hsdp does)")
    return f"dp_replicate={sizes['dp_replicate']},dp_shard={sizes['dp_shard']}"

"""The parallel plan: how this launch splits the work, read once from what `accelerate launch` set.

Today the plan has one dimension: every process is a data-parallel rank (DDP, FSDP2 and ZeRO-1/2/3 differ in
what they shard, not in who reads which data). The rest of the run asks the plan, never the environment:
the strategy and its label for output.dir, the ZeRO stage, the checkpoint's strategy, which data rank this
process is and how many there are (the data feed shards by them). Token counts and losses are reduced over
every process today (the loop uses the default group). A mesh (long context: context / sequence / tensor
parallel ranks that share a batch) extends this object with its groups; data rank and process rank then
differ, and the feed and the loop ask the plan instead of the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.runtime.backends import launcher_strategy, run_label, world_size, zero_stage


@dataclass(frozen=True)
class ParallelPlan:
    strategy: str  # single, ddp, fsdp, deepspeed (what accelerate launched)
    label: str  # output.dir's {strategy}, as the config files are named: ddp, fsdp_offload, zero3, ...
    zero_stage: int | None  # DeepSpeed only
    processes: int

    @classmethod
    def from_launch(cls) -> ParallelPlan:
        return cls(launcher_strategy(), run_label(), zero_stage(), world_size())

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

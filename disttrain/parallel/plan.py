"""The parallel plan: how this launch splits the work, read once from what `accelerate launch` set.

Every process is a data-parallel rank under DDP, FSDP2, HSDP and ZeRO-1/2/3 (they differ in what they shard,
not in who reads which data). Ulysses sequence parallelism (DeepSpeed's ALST on accelerate's
ParallelismConfig, `sp`) groups sp consecutive processes around one sequence: they read the same rows and
each keeps 1/sp of every sequence (data.collation.SequenceShard), so the data rank is process // sp. Context
parallelism (torch's ring attention under FSDP2, `cp`) groups cp consecutive processes the same way; each gets
the whole sequence from the loader (data.collation.ContextShard) and accelerate's context cuts it in place for
every micro-batch (`micro_batch_context`), forward and backward inside it. The rest
of the run asks the plan, never the environment: the strategy and its label for output.dir, the ZeRO stage,
the checkpoint's strategy and mesh, which data rank this process is and how many there are (the feed shards
by them), which slice of each sequence it keeps. Token counts and losses are reduced over every process: each
counts only its own slice, and every strategy here averages gradients over all processes (ZeRO-3 under
Ulysses reduces over dp x sp, FSDP2 under CP over dp_shard x cp). Tensor parallelism alone (`tp` = every
process, accelerate_configs/tp.yaml) makes all processes one group around the same batch: each holds 1/tp of
every split weight and counts 1/tp of the batch in the metrics (`share`), and its gradients need no averaging
(the loss's denominator, summed over tp identical counts and divided by the processes, is the batch's own).
FSDP2 + TP (accelerate_configs/fsdp_tp.yaml: tp x dp_shard, optionally x dp_replicate) keeps the tp groups and
lays FSDP2 over them, as transformers does it at load time (`fsdp_data`): the data rank is process // tp, FSDP
averages the gradients over the data ranks (the denominator, tp identical counts per group, divided by the
processes, is the groups' mean: exact again). Context and sequence parallelism do not combine with TP.
Expert parallelism (accelerate_configs/fsdp_ep.yaml: dp_shard, optionally x dp_replicate, the experts split over
ep of each replica's processes) is data-parallel for every dense weight: each process reads its own rows and draws
its own stream, transformers' FSDP2 averages the dense gradients over all processes and the experts' (whose tokens
came to them by all-to-all from every process of their group) over the same count, as one process's mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from disttrain.parallel.mesh import read_mesh
from disttrain.parallel.modes import DataParallel, mode_for
from disttrain.runtime.backends import launcher_strategy, run_label, world_size, zero_stage


@dataclass(frozen=True)
class ParallelPlan:
    strategy: str  # single, ddp, fsdp, deepspeed (what accelerate launched)
    label: str  # output.dir's {strategy}, as the config files are named: ddp, fsdp_offload, zero3, ...
    zero_stage: int | None  # DeepSpeed only
    processes: int
    mesh: str | None = None  # "dp_replicate=R,dp_shard=S" (HSDP), "dp_shard=D,sp=S" (Ulysses), "dp_shard=D,cp=C"
    sp: int = 1  # processes that share each sequence, each keeping 1/sp of it (Ulysses)
    cp: int = 1  # processes that share each sequence around the attention ring (context parallelism)
    tp: int = 1  # processes that share each batch whole, each holding 1/tp of the weights (tensor parallelism)
    ep: int = 1  # processes that split each MoE block's experts between them (expert parallelism)
    # around tensor or expert parallelism: (replicas, shards) of the FSDP2 transformers lays over the processes
    fsdp_data: tuple[int, int] = (1, 1)
    pp: int = 1  # pipeline stages, each over processes / pp data-parallel processes (pipeline parallelism)

    @classmethod
    def from_launch(cls) -> ParallelPlan:
        mesh = read_mesh(launcher_strategy(), world_size())
        return cls(launcher_strategy(), run_label(), zero_stage(), world_size(), mesh.label, mesh.sp, mesh.cp,
                   mesh.tp, mesh.ep, mesh.fsdp_data, mesh.pp)

    @cached_property
    def mode(self) -> DataParallel:
        """The mode object that answers every question the mesh decides (modes.py)."""
        return mode_for(self.sp, self.cp, self.tp, self.ep, self.fsdp_data, self.pp)

    @property
    def group(self) -> int:
        """Consecutive processes that read the same rows (a sequence-, context- or tensor-parallel group)."""
        return self.mode.group

    @property
    def share(self) -> float:
        """The part of each batch this process accounts for in token counts, losses and FLOPs."""
        return self.mode.share

    @property
    def checkpoint_strategy(self) -> str:
        """The strategy a checkpoint records: one process is DDP-compatible (its files load under DDP)."""
        return "ddp" if self.strategy == "single" else self.strategy

    @property
    def tensor_parallel(self) -> bool:
        """The weights are split across processes (tp.yaml, fsdp_tp.yaml)."""
        return self.mode.tensor_parallel

    @property
    def sequence_parts(self) -> int:
        """Processes each sequence is cut over (Ulysses' sp, the ring's cp): NEFTune scales its noise by it."""
        return self.mode.sequence_parts

    def check_recipe(self, recipe, gpu: bool) -> None:
        """What this mesh refuses of a recipe, in one line each, before the process group exists."""
        self.mode.check_recipe(recipe, gpu)

    def check_model(self, recipe) -> None:
        """What this mesh refuses of the recipe's model, from its config.json alone (before any weight)."""
        self.mode.check_model(recipe)

    def load_kwargs(self) -> dict:
        """What model loading needs to know of the mesh (tensor or expert parallelism: transformers splits as it
        loads)."""
        return self.mode.load_kwargs()

    def prepare_model(self, accelerator, model, optimizer):
        """The model through accelerate before the rest is prepared with it (modes.py: what accelerate must leave
        as it is; a pipeline's stage, and the optimizer pointed at its parameters)."""
        return self.mode.prepare_model(accelerator, model, optimizer)

    def window_runner(self, run):
        """What runs each window's micro-batches instead of the loop's one-at-a-time path (a pipeline's schedule),
        or None."""
        return self.mode.window_runner(run)

    def eval_model(self, run):
        """What evaluation calls as the model (a pipeline: a forward through every stage), run: loop.Run."""
        return self.mode.eval_model(run)

    def data_rank(self, accelerator) -> int:
        """Which share of the data this process reads: the processes of a group read the same."""
        return self.mode.data_rank(accelerator.process_index)

    def data_ranks(self, accelerator) -> int:
        return self.mode.data_ranks(accelerator.num_processes)

    def data_rank_of(self, processes: int) -> list[int]:
        """The data rank of every process (the metrics compare data ranks)."""
        return [self.mode.data_rank(process) for process in range(processes)]

    def random_stream(self, accelerator) -> int:
        """Which random stream this process draws from while training (modes.py says why per mode)."""
        return self.mode.random_stream(accelerator.process_index)

    def sequence_slice(self, accelerator) -> tuple[int, int] | None:
        """Ulysses: (which slice, of how many) of every training sequence the loader gives this process."""
        return self.mode.sequence_slice(accelerator.process_index)

    def context_slice(self, accelerator) -> tuple[int, int] | None:
        """Context parallelism: (which part, of how many) of every sequence accelerate's context keeps here."""
        return self.mode.context_slice(accelerator.process_index)

    def eval_loader(self, accelerator, loader):
        """An eval set's loader as the mode reads eval sets."""
        return self.mode.eval_loader(accelerator, loader)

    def micro_batch_context(self, accelerator, model):
        """What the loop enters around each micro-batch's forward and backward (inside accelerate's
        `accumulate`, which has set `sync_gradients` by then)."""
        return self.mode.micro_batch_context(accelerator, model)

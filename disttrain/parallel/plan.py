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
lays FSDP2 over them, as transformers does it at load time (`tp_data`): the data rank is process // tp, FSDP
averages the gradients over the data ranks (the denominator, tp identical counts per group, divided by the
processes, is the groups' mean: exact again). Context and sequence parallelism do not combine with TP.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from disttrain.parallel import checks
from disttrain.parallel.mesh import read_mesh
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
    tp_data: tuple[int, int] = (1, 1)  # around tensor parallelism: (replicas, shards) of FSDP2 over the tp groups

    @classmethod
    def from_launch(cls) -> ParallelPlan:
        mesh, sp, cp, tp, tp_data = read_mesh(launcher_strategy(), world_size())
        return cls(launcher_strategy(), run_label(), zero_stage(), world_size(), mesh, sp, cp, tp, tp_data)

    @property
    def group(self) -> int:
        """Consecutive processes that read the same rows (a sequence-, context- or tensor-parallel group)."""
        return self.sp * self.cp * self.tp

    @property
    def share(self) -> float:
        """The part of each batch this process accounts for in token counts, losses and FLOPs: sp/cp processes
        count only their own slice (1); tensor-parallel ones all see the whole batch and each does 1/tp of its
        work, so each counts 1/tp of it (summed over the group: the batch once)."""
        return 1.0 / self.tp

    @property
    def checkpoint_strategy(self) -> str:
        """The strategy a checkpoint records: one process is DDP-compatible (its files load under DDP)."""
        return "ddp" if self.strategy == "single" else self.strategy

    @property
    def tensor_parallel(self) -> bool:
        """The weights are split across processes (tp.yaml, fsdp_tp.yaml)."""
        return self.tp > 1

    @property
    def sequence_parts(self) -> int:
        """Processes each sequence is cut over (Ulysses' sp, the ring's cp): NEFTune scales its noise by it."""
        return self.sp * self.cp

    def check_recipe(self, recipe, gpu: bool) -> None:
        """What this mesh refuses of a recipe, in one line each, before the process group exists."""
        checks.check_sequence_parallel(recipe, self.sp, self.cp)
        checks.check_ring_kernel(self.cp, gpu)
        checks.check_tensor_parallel(recipe, self.tp, self.tp_data[0] * self.tp_data[1])

    def check_model(self, recipe) -> None:
        """What this mesh refuses of the recipe's model, from its config.json alone (before any weight)."""
        checks.check_model_config(recipe, self.sp, self.cp, self.tp, self.tp_data[0] * self.tp_data[1])

    def load_kwargs(self) -> dict:
        """What model loading needs to know of the mesh: transformers splits (and under FSDP2 + TP shards) the
        model as it loads it (model/loading.py)."""
        return {"tp": self.tp, "tp_data": self.tp_data}

    def data_rank(self, accelerator) -> int:
        """Which share of the data this process reads: the processes of a sequence group read the same."""
        return accelerator.process_index // self.group

    def data_ranks(self, accelerator) -> int:
        return accelerator.num_processes // self.group

    def random_stream(self, accelerator) -> int:
        """Which random stream this process draws from while training (dropout, LoRA dropout, NEFTune's noise):
        the processes of a tensor-parallel group run the same batch on the same activations, so they draw the
        same stream (different masks would make the adapters they hold whole drift apart, and NEFTune add
        different noise to an all-reduced embedding); every other process holds other tokens (data ranks,
        Ulysses' and the ring's slices of a sequence) and draws its own, as one process draws independently
        for every position."""
        return accelerator.process_index // self.tp

    def sequence_slice(self, accelerator) -> tuple[int, int] | None:
        """Ulysses: (which slice, of how many) of every training sequence the loader gives this process; None:
        all of it."""
        return (accelerator.process_index % self.sp, self.sp) if self.sp > 1 else None

    def context_slice(self, accelerator) -> tuple[int, int] | None:
        """Context parallelism: (which part, of how many) of every sequence accelerate's context keeps here."""
        return (accelerator.process_index % self.cp, self.cp) if self.cp > 1 else None

    def eval_loader(self, accelerator, loader):
        """An eval set's loader: split by process, or under tensor parallelism whole on every process (the
        processes of the tensor-parallel group run the same batches together). Under context parallelism the
        eval forward runs outside the ring's context on whole rows, so the rows are split over every process, not
        by data rank as accelerate's prepare splits them (the cp processes of a group then held the same rows,
        and gather_for_metrics, which truncates the last batch as if rows were split by process, counted some
        twice and dropped others)."""
        if self.cp > 1:
            from accelerate.data_loader import prepare_data_loader

            return prepare_data_loader(loader, accelerator.device, num_processes=accelerator.num_processes,
                                       process_index=accelerator.process_index, put_on_device=True)
        if self.tp == 1:
            return accelerator.prepare(loader)
        from disttrain.runtime.backends import ReplicatedLoader

        return ReplicatedLoader(loader, accelerator.device)

    def micro_batch_context(self, accelerator, model):
        """What the loop enters around each micro-batch's forward and backward (inside accelerate's
        `accumulate`, which has set `sync_gradients` by then): under context parallelism, accelerate's context,
        which cuts the batch's sequences in place (the ring attention needs backward inside it too: outside,
        the gradients are silently wrong); under FSDP2 + TP, the gradient reduction deferred to the window's
        last micro-batch (accelerate defers DDP's and its own FSDP2's, not the FSDP2 transformers applied);
        otherwise nothing."""
        if self.cp > 1:
            from disttrain.data.collation import CONTEXT_BUFFERS

            def context(batch: dict):
                buffers = [batch[key] for key in CONTEXT_BUFFERS if key in batch]
                return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                          no_restore_buffers=set(buffers))
            return context
        if self.tp > 1 and self.tp_data != (1, 1):
            return lambda batch: _reduce_on_last_micro_batch(accelerator, model, replicas=self.tp_data[0])
        return lambda batch: nullcontext()


@contextmanager
def _reduce_on_last_micro_batch(accelerator, model, replicas: int):
    """FSDP2's `no_sync` for the micro-batches before the last of a window: with replicas (HSDP) only the
    all-reduce across them waits, the reduce-scatter inside each keeps the gradients sharded."""
    if not accelerator.sync_gradients:
        if replicas > 1:
            model.set_requires_all_reduce(False)
        else:
            model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)

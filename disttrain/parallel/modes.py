"""One small object per parallel mode, each answering the same questions for its mesh: which processes read the
same rows, what each counts of a batch, which random stream it draws, which slice of a sequence it keeps, how
eval sets are read, what a micro-batch runs inside, what the mode refuses of a recipe and of a model, and what
model loading needs. ParallelPlan (plan.py) holds the launch's mode and asks it; nothing else branches on the
mesh. A new mesh is a class here (with its config file and make target) and a line in `mode_for`.

    DataParallel   DDP, FSDP2, HSDP, ZeRO-1/2/3 (what they shard is the accelerate config's business, not
                   the plan's): every process reads its own rows, whole
    Ulysses        DeepSpeed's sequence parallelism: sp processes per sequence, each keeps 1/sp of it
    Ring           torch's context parallelism under FSDP2: cp processes per sequence around the attention ring
    Tensor         tensor parallelism alone or under FSDP2 (transformers' plan): tp processes per batch, each
                   holding 1/tp of the split weights
    Expert         expert parallelism under FSDP2 (transformers' plans): every process reads its own rows, each
                   holds 1/ep of every MoE block's experts and the tokens travel to them
    Pipeline       pipeline parallelism (pipeline.py): pp stages of dp processes, the processes of a pipeline
                   (dp apart) read the same rows, each holds one stage's layers, FSDP2 over each stage's dp
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from disttrain.parallel import checks


class DataParallel:
    group = 1  # consecutive processes that read the same rows
    share = 1.0  # the part of each batch a process counts in token counts, losses and FLOPs
    sequence_parts = 1  # processes each sequence is cut over
    tensor_parallel = False

    def random_stream(self, process: int) -> int:
        """Which random stream a process draws while training (dropout, LoRA dropout, NEFTune's noise): every
        process holds other tokens and draws its own, as one process draws independently for every position."""
        return process

    def data_rank(self, process: int) -> int:
        """Which share of the data a process reads: the group's consecutive processes read the same."""
        return process // self.group

    def data_ranks(self, processes: int) -> int:
        return processes // self.group

    def sequence_slice(self, process: int) -> tuple[int, int] | None:
        """(which slice, of how many) of every training sequence the loader gives the process; None: all."""
        return None

    def context_slice(self, process: int) -> tuple[int, int] | None:
        """(which part, of how many) of every sequence the micro-batch context keeps; None: all."""
        return None

    def eval_loader(self, accelerator, loader):
        """An eval set's loader: its rows split over the processes."""
        return accelerator.prepare(loader)

    def micro_batch_context(self, accelerator, model):
        """What the loop enters around each micro-batch's forward and backward: nothing."""
        return lambda batch: nullcontext()

    def check_recipe(self, recipe, gpu: bool) -> None:
        """What the mode refuses of a recipe, one line each: nothing beyond the strategy's own checks."""

    def check_model(self, recipe) -> None:
        """What the mode refuses of the recipe's model (its config.json alone, before any weight): what every
        launch refuses of it (a vision-language model's unproven combinations)."""
        checks.check_model_config(recipe, 1, 1, 1, 1)

    def load_kwargs(self) -> dict:
        """What model loading needs of the mode: nothing (accelerate wraps or shards after loading)."""
        return {}

    def prepare_model(self, accelerator, model, optimizer):
        """The model before accelerate prepares it with the rest: as loaded (accelerate wraps or shards it)."""
        return model

    def window_runner(self, run):
        """What runs a window's micro-batches forward and backward instead of the loop's one-at-a-time path
        (loop.py), or None: the loop's own."""
        return None

    def eval_model(self, run):
        """What evaluation calls as the model (training/hooks.py): the model itself."""
        return run.model


class Ulysses(DataParallel):
    """The sp processes of a group read the same rows; the feed's collator keeps each process's 1/sp of every
    sequence, labels shifted before the cut (data.collation.SequenceShard)."""

    def __init__(self, sp: int):
        self.sp = self.group = self.sequence_parts = sp

    def sequence_slice(self, process: int) -> tuple[int, int]:
        return process % self.sp, self.sp

    def check_recipe(self, recipe, gpu: bool) -> None:
        checks.check_sequence_parallel(recipe, self.sp, 1)

    def check_model(self, recipe) -> None:
        checks.check_model_config(recipe, self.sp, 1, 1, 1)


class Ring(DataParallel):
    """The cp processes of a group read the same whole sequences (labels shifted over the whole sequence:
    data.collation.ContextShard) and accelerate's context cuts them in place around every micro-batch."""

    def __init__(self, cp: int):
        self.cp = self.group = self.sequence_parts = cp

    def context_slice(self, process: int) -> tuple[int, int]:
        return process % self.cp, self.cp

    def eval_loader(self, accelerator, loader):
        """The eval forward runs outside the ring's context on whole rows, so the rows are split over every
        process, not by data rank as accelerate's prepare splits them (the cp processes of a group then held the
        same rows, and gather_for_metrics, which truncates the last batch as if rows were split by process,
        counted some twice and dropped others)."""
        from accelerate.data_loader import prepare_data_loader

        return prepare_data_loader(loader, accelerator.device, num_processes=accelerator.num_processes,
                                   process_index=accelerator.process_index, put_on_device=True)

    def micro_batch_context(self, accelerator, model):
        """accelerate's context, which cuts the batch's sequences in place (the ring attention needs the
        backward inside it too: outside, the gradients are silently wrong)."""
        from disttrain.data.collation import CONTEXT_BUFFERS

        def context(batch: dict):
            buffers = [batch[key] for key in CONTEXT_BUFFERS if key in batch]
            return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                      no_restore_buffers=set(buffers))
        return context

    def check_recipe(self, recipe, gpu: bool) -> None:
        checks.check_sequence_parallel(recipe, 1, self.cp)
        checks.check_ring_kernel(self.cp, gpu)

    def check_model(self, recipe) -> None:
        checks.check_model_config(recipe, 1, self.cp, 1, 1)


class Tensor(DataParallel):
    """All tp processes of a group see the whole batch and each holds 1/tp of every split weight, so each
    counts 1/tp of it (summed over the group: the batch once); they run the same activations, so they draw the
    same random stream (different dropout masks would make the adapters they hold whole drift apart, and
    NEFTune add different noise to an all-reduced embedding). Under FSDP2 + TP (`data`: replicas x shards of
    FSDP2 over the groups, laid out by transformers) the gradient reduction waits for the window's last
    micro-batch."""

    tensor_parallel = True

    def __init__(self, tp: int, data: tuple[int, int] = (1, 1)):
        self.tp = self.group = tp
        self.data = data
        self.share = 1.0 / tp

    def random_stream(self, process: int) -> int:
        return process // self.tp

    def eval_loader(self, accelerator, loader):
        """Whole on every process: the group runs the same batches together."""
        from disttrain.runtime.backends import ReplicatedLoader

        return ReplicatedLoader(loader, accelerator.device)

    def micro_batch_context(self, accelerator, model):
        """accelerate defers DDP's and its own FSDP2's reduction on accumulation, not the FSDP2 transformers
        applied under FSDP2 + TP: deferred here."""
        if self.data == (1, 1):
            return super().micro_batch_context(accelerator, model)
        return lambda batch: _reduce_on_last_micro_batch(accelerator, model, replicas=self.data[0])

    def check_recipe(self, recipe, gpu: bool) -> None:
        checks.check_tensor_parallel(recipe, self.tp, self.data[0] * self.data[1])

    def check_model(self, recipe) -> None:
        checks.check_model_config(recipe, 1, 1, self.tp, self.data[0] * self.data[1])

    def load_kwargs(self) -> dict:
        """transformers splits (and under FSDP2 + TP shards) the model as it loads it (model/loading.py)."""
        return {"tp": self.tp, "fsdp_data": self.data}


class Expert(DataParallel):
    """Expert parallelism under FSDP2, both laid out by transformers as it loads the model (its expert-parallel
    plan: each MoE block's experts split over groups of ep processes, the tokens sent to their experts and back by
    all-to-all; its FSDP plan over the `data` replicas x shards for the rest, and for the experts over the
    processes holding the same ones). Every process reads its own rows and draws its own stream, as under FSDP2;
    accelerate leaves the model as it is; the gradient reduction waits for the window's last micro-batch, and
    LoRA's adapters, which peft adds after transformers' FSDP2 and which no FSDP2 group reduces, are averaged over
    the processes then, as DDP averages them."""

    def __init__(self, ep: int, data: tuple[int, int]):
        self.ep, self.data = ep, data

    def micro_batch_context(self, accelerator, model):
        _ReplicatedGradients.install(accelerator, model)
        return lambda batch: _reduce_on_last_micro_batch(accelerator, model, replicas=self.data[0])

    def check_recipe(self, recipe, gpu: bool) -> None:
        checks.check_expert_parallel(recipe, self.ep)

    def check_model(self, recipe) -> None:
        checks.check_model_config(recipe, 1, 1, 1, 1)
        checks.check_expert_parallel_model(recipe, self.ep, self.data)

    def load_kwargs(self) -> dict:
        """transformers splits the experts and shards the model as it loads it (model/loading.py)."""
        return {"ep": self.ep, "fsdp_data": self.data}

    def prepare_model(self, accelerator, model, optimizer):
        return _prepared_as_it_is(accelerator, model)


def _prepared_as_it_is(accelerator, model):
    """accelerate's own preparation (mixed precision's autocast) without its wrapping: on a MULTI_GPU launch it
    would wrap an FSDP2 model in DDP, which refuses DTensor parameters."""
    model = accelerator.prepare_model(model, evaluation_mode=True)
    model._is_accelerate_prepared = True  # accelerator.prepare(model, ...) then keeps it as it is
    return model


class Pipeline(DataParallel):
    """Pipeline parallelism (pipeline.py): the processes of a pipeline read the same rows and hold its stages, so
    each counts 1/pp of a batch (its loss, known on the last stage, all-reduced over the pipeline each step); the
    model is cut to this process's stage, FSDP2-sharded over the stage's dp processes, and the optimizer made
    before the cut keeps only the stage's parameters (as accelerate re-points an optimizer at FSDP2's). The
    loop hands each window whole to the stage's schedule."""

    def __init__(self, pp: int, dp: int):
        self.pp, self.dp = pp, dp
        self.group = pp  # the processes that read the same rows (dp apart, not consecutive: data_rank says which)
        self.share = 1.0 / pp

    def data_rank(self, process: int) -> int:
        return process % self.dp  # pp outermost: a pipeline's processes are dp apart

    def data_ranks(self, processes: int) -> int:
        return self.dp

    def place(self, process: int, num_layers: int):
        from disttrain.model.stages import StagePlace, stage_layers

        stage = process // self.dp
        return StagePlace(stage, self.pp, process % self.dp, self.dp, stage_layers(num_layers, stage, self.pp))

    def check_recipe(self, recipe, gpu: bool) -> None:
        checks.check_pipeline(recipe, self.pp)

    def check_model(self, recipe) -> None:
        checks.check_model_config(recipe, 1, 1, 1, 1)
        checks.check_pipeline_model(recipe, self.pp)

    def prepare_model(self, accelerator, model, optimizer):
        from torch.distributed.device_mesh import init_device_mesh

        from disttrain.parallel import pipeline

        self.mesh = init_device_mesh(accelerator.device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        place = self.place(accelerator.process_index, pipeline.causal_lm(model).config.num_hidden_layers)
        return _prepared_as_it_is(accelerator, pipeline.prepare(model, optimizer, place, self.mesh,
                                                                accelerator.device))

    def window_runner(self, run):
        from disttrain.parallel import pipeline

        return pipeline.window_runner(run, self.mesh)

    def eval_loader(self, accelerator, loader):
        """Whole on every process: a pipeline's stages run the same batches (and every pipeline all of them:
        gathered for metrics, each row counts on both sides of every ratio alike)."""
        from disttrain.runtime.backends import ReplicatedLoader

        return ReplicatedLoader(loader, accelerator.device)

    def eval_model(self, run):
        """A forward through every stage per call (pipeline.EvalForward)."""
        from disttrain.parallel.pipeline import EvalForward

        data, training = run.recipe.data, run.recipe.training
        return EvalForward(run.model, self.mesh, training.micro_batch_size, data.max_seq_len, run.accelerator.device,
                           run.accelerator.autocast)


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


class _ReplicatedGradients:
    """The trainable parameters outside transformers' FSDP2 (LoRA's adapters, which peft adds after it: whole on
    every process) get their gradients averaged over the processes at the end of the window's last backward, as
    DDP averages them: one all-reduce of them flattened, queued on autograd's engine by the first of them whose
    gradient is complete, so it runs before the loop clips and steps (inside the micro-batch)."""

    def __init__(self, accelerator, params: list):
        self.accelerator, self.params, self.queued = accelerator, params, False
        for param in params:
            param.register_post_accumulate_grad_hook(self._queue)

    @classmethod
    def install(cls, accelerator, model) -> None:
        from torch.distributed.tensor import DTensor

        if getattr(model, "_disttrain_replicated_gradients", None) is None:
            params = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
            model._disttrain_replicated_gradients = cls(accelerator, params) if params else False

    def _queue(self, _param) -> None:
        import torch

        if self.accelerator.sync_gradients and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        import torch
        import torch.distributed as dist

        self.queued = False
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def mode_for(sp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, fsdp_data: tuple[int, int] = (1, 1),
             pp: int = 1) -> DataParallel:
    """The mode of a mesh read from the launch (mesh.read_mesh has refused the combinations it does not run)."""
    if pp > 1:
        return Pipeline(pp, fsdp_data[1])
    if ep > 1:
        return Expert(ep, fsdp_data)
    if sp > 1:
        return Ulysses(sp)
    if cp > 1:
        return Ring(cp)
    if tp > 1:
        return Tensor(tp, fsdp_data)
    return DataParallel()

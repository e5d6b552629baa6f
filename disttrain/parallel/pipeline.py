"""Pipeline parallelism: the model cut into stages by its decoder layers, one stage per process of a pipeline,
run by torch.distributed.pipelining's schedules (GPipe, 1F1B), FSDP2 over each stage's data-parallel processes.

The mesh is (pp, dp), pp outermost as torchtitan lays it: stage s is processes s*dp .. s*dp + dp - 1, so the
stages of one pipeline sit dp processes apart (across nodes when a node holds dp of them: only activations cross
the slow link, while FSDP2's all-gathers stay inside a node), and data rank d is the processes d, d + dp, ... .

The stages: disttrain/model/stages.py cuts the HF model itself by its decoder layers (the names kept whole); the
last stage returns the micro-batch's summed token loss through the chunked head of objectives/token_loss.py (no
full-vocabulary logits).

The loss: one optimizer step is one schedule step over the window's grad_accum micro-batches (each one of the
schedule's micro-batches, padded to data.max_seq_len: the schedule infers the shapes it sends once). Each
micro-batch's loss is its summed token loss / (the window's target tokens over all data ranks / dp), so that
FSDP2's mean over the dp processes leaves exactly the token-weighted mean of one process (loop.py). Gradient
clipping takes the total norm over every stage (each stage's squared norm, all-reduced over its pipeline).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from disttrain.data import IGNORE_INDEX
from disttrain.errors import DisttrainError
from disttrain.model.stages import StagePlace

PIPELINE_CONFIG = "accelerate_configs/fsdp_pp.yaml"  # its size: runtime/backends.PIPELINE_ENV (make sets it)
# families whose inner model forward takes inputs_embeds as the hidden states, adding nothing to them (Gemma
# scales its embeddings inside that forward: a middle stage would scale them again) and whose causal LM adds
# nothing but lm_head to it (a mixture of experts' router loss, which it would add, is refused)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # one stage per process (interleaved schedules hold several)


def check_model(config, name: str, pp: int, router_loss: bool = False) -> None:
    """What the model's config alone says about cutting it into pp stages, one line each (`router_loss`: the
    model's forward would add a mixture of experts' load-balancing loss, which the stages do not)."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in FAMILIES:
        raise DisttrainError(f"{name} is a {model_type} model: pipeline parallelism ({PIPELINE_CONFIG}) cuts "
                             f"{', '.join(FAMILIES)} models here (the stage forward of other families is unverified); "
                             "train it under fsdp.yaml, hsdp.yaml or a ZeRO config")
    if getattr(config, "tie_word_embeddings", False):
        raise DisttrainError(f"{name} ties its input and output embeddings (tie_word_embeddings): under pipeline "
                             "parallelism they sit on the first and the last stage, whose gradients are not summed "
                             "here; use fsdp.yaml for it")
    if router_loss:
        raise DisttrainError(f"{name} trains its router's load-balancing loss (model.router_aux_loss_coef, or its "
                             f"config's output_router_logits): pipeline parallelism ({PIPELINE_CONFIG}) does not add "
                             "it yet; set model.router_aux_loss_coef=0, or train it under fsdp.yaml or fsdp_ep.yaml")
    layers = config.num_hidden_layers
    if layers % pp:
        raise DisttrainError(f"{name} has {layers} decoder layers: {pp} pipeline stages need them divisible by {pp} "
                             f"(make train-fsdp-pp PP=N with N dividing {layers})")


def padded(tensor: torch.Tensor, rows: int, length: int, value: int) -> torch.Tensor:
    """A [rows', length'] batch tensor padded to rows x length with `value` (right: a causal model's real tokens
    never attend to what follows them), the shape the schedule inferred on its first step and sends ever since."""
    got_rows, got_length = tensor.shape
    if got_length > length:
        raise DisttrainError(f"a micro-batch of {got_length} tokens is longer than data.max_seq_len={length}, which "
                             "pipeline parallelism pads every micro-batch to")
    return nn.functional.pad(tensor, (0, length - got_length, 0, rows - got_rows), value=value)


class PipelineRunner:
    """The schedule of one stage: runs a window of micro-batches forward and backward, and clips the gradients by
    the norm over every stage."""

    def __init__(self, model, place: StagePlace, mesh, schedule: str, microbatches: int, rows: int, length: int,
                 device: torch.device):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.place, self.rows, self.length, self.device = place, rows, length, device
        self.group = mesh["pp"].get_group()
        self.model = model
        self.scale = None  # the window's divisor, set before each step
        stage = PipelineStage(model, place.stage, place.stages, device, group=self.group)
        self.schedule = get_schedule_class(SCHEDULES[schedule])(stage, n_microbatches=microbatches,
                                                                 loss_fn=self._loss, scale_grads=False)

    def _loss(self, summed: torch.Tensor, _target) -> torch.Tensor:
        return summed / self.scale

    def run(self, micro_batches: list[dict], scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the window (`scale`: what each micro-batch's summed loss is divided by);
        returns each micro-batch's summed token loss, the same on every stage (one all-reduce over the pipeline)."""
        # stacked, as the schedule splits them again
        ids = torch.cat([padded(b["input_ids"], self.rows, self.length, 0) for b in micro_batches])
        labels = torch.cat([padded(b["labels"], self.rows, self.length, IGNORE_INDEX) for b in micro_batches])
        self.scale, losses = scale, []
        if self.place.first:
            self.schedule.step(ids.to(self.device))
        elif self.place.last:
            self.schedule.step(labels=labels.to(self.device), target=labels.to(self.device), losses=losses,
                               return_outputs=False)
        else:
            self.schedule.step()
        sums = torch.stack(losses).detach() * scale if losses else torch.zeros(len(micro_batches), device=self.device)
        torch.distributed.all_reduce(sums, group=self.group)  # only the last stage's are non-zero
        return sums

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """The total gradient norm over every stage (clipped to max_norm where set), as one model's."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):  # FSDP2: the norm of this stage's shards over its data-parallel processes
            norm = norm.full_tensor()
        squared = norm.float() ** 2
        torch.distributed.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


class EvalForward:
    """The model as evaluation calls it (training/hooks.evaluate, the loss engine's `model(**inputs)`): each call
    runs one forward-only pass of the batch through every stage (its own PipelineStage and GPipe schedule of one
    micro-batch, padded to micro_batch_size x max_seq_len: the schedule sends the shapes it inferred first) and
    returns, on every stage, what the last stage's lm_head returned for the real rows and positions (the engine's
    per-token losses: its labels, set on the head, are padded alike for the call)."""

    def __init__(self, model, mesh, rows: int, length: int, device, autocast):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import ScheduleGPipe

        from disttrain.model.stages import stage_of

        self.model, self.place, self.rows, self.length, self.device = model, stage_of(model), rows, length, device
        self.autocast = autocast  # accelerate's, as around the training windows
        self.base = causal_lm(model)
        self.group = mesh["pp"].get_group()
        stage = PipelineStage(self.base, self.place.stage, self.place.stages, device, group=self.group)
        self.schedule = ScheduleGPipe(stage, n_microbatches=1)  # no loss: forward only

    def eval(self):
        self.model.eval()

    def train(self):
        self.model.train()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, **_inputs):
        with self.autocast():
            return self._forward(input_ids)

    def _forward(self, input_ids: torch.Tensor):
        rows, length = input_ids.shape
        values = torch.zeros(rows, length, device=self.device)
        if self.place.first:
            self.schedule.eval(padded(input_ids, self.rows, self.length, 0))
        elif self.place.last:
            head = self.base.lm_head
            set_labels = head._disttrain_labels  # the engine's, for this call: padded as the batch is
            head._disttrain_labels = padded(set_labels, self.rows, self.length, IGNORE_INDEX)
            try:
                # contiguous: a collective reads the tensor's storage as one block (a sliced view is not one)
                values = self.schedule.eval()[:rows, :length].float().contiguous()
            finally:
                head._disttrain_labels = set_labels
        else:
            self.schedule.eval()
        torch.distributed.all_reduce(values, group=self.group)  # only the last stage's are non-zero
        return SimpleNamespace(logits=values)


def causal_lm(model):
    """The causal LM itself: peft's wrapper's base (the stage module a schedule runs), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cut(model, place: StagePlace):
    """The model cut to its stage (model/stages.py), the last stage's loss the chunked head's summed token loss."""
    from disttrain.model.stages import cut_to_stage
    from disttrain.objectives.token_loss import chunked_loss_sum

    return cut_to_stage(model, place, chunked_loss_sum)


def prepare(model, optimizer, place: StagePlace, mesh, device):
    """The loaded model (a causal LM, or peft's wrapper of one: its adapters train on their layers' stage) cut to
    this process's stage, FSDP2-sharded over the stage's processes (each decoder layer, then the rest), and the
    optimizer made before the cut pointed at the stage's parameters (as accelerate re-points an optimizer at
    FSDP2's); returns the model to prepare (the wrapper, for LoRA)."""
    names = {id(param): name for name, param in model.named_parameters()}
    base = causal_lm(model)
    cut(base, place).to(device)
    if place.data_ranks > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(base, mesh=mesh["dp"])
    model._disttrain_stage = place  # on peft's wrapper too: what holds the stage is asked, not its type
    kept = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [kept[names[id(p)]] for p in group["params"] if names[id(p)] in kept]
    return model


def window_runner(run, mesh):
    """What the loop calls with each window (loop.py): the stage's schedule forward and backward, the clipping
    over every stage, the optimizer step; it returns each micro-batch's summed loss."""
    from disttrain.model.stages import stage_of

    cfg, model = run.recipe.training, run.model
    base = causal_lm(model)
    runner = PipelineRunner(base, stage_of(model), mesh, cfg.pp_schedule, cfg.grad_accum, cfg.micro_batch_size,
                            run.recipe.data.max_seq_len, run.accelerator.device)
    optimizer = run.trainable.optimizer
    # the start-up self-check runs the whole model's forward, which no stage holds; a stage's loss is the chunked
    # head's own function (tests/test_loss_impl.py), on the families check_model lets through
    run.loss.waive_check()

    def run_window(micro_batches: list, denominator, window):
        # each micro-batch's summed loss / (the window's targets / dp): accelerate's /grad_accum undone
        with run.accelerator.autocast():  # a LoRA stage runs below peft's wrapper, whose forward accelerate wraps
            sums = runner.run(micro_batches, denominator * cfg.grad_accum)
        window.last_grad_norm = runner.clip(cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sums
    return run_window

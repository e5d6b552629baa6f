"""Time, cost and memory fit of a training run, per strategy: `make cost ARGS='...'`.

    python -m disttrain.tools.cost --params 7e9 --tokens 100e9 --gpu "RTX 4090" --gpus 4 --strategy fsdp
    python -m disttrain.tools.cost --recipe recipes/qwen2.5-7b/lora_sft.yaml --tokens 1e9 --gpu H100 --gpus 8

Compute: FLOPs = tokens x FLOPs/token (disttrain/metrics/flops.py: 6N + attention, LoRA-aware); time = FLOPs /
(GPUs x dense peak x MFU). MFU is an assumption per strategy unless --mfu or a measured bench result
(--bench bench/results.json) replaces it. Memory per GPU: model states by the ZeRO paper's accounting
(16 bytes/parameter for mixed-precision Adam, divided per stage; FSDP reduce-scatters every micro-batch by
default, so gradients stay sharded: a recipe with distributed.fsdp_sync_each_micro_batch=false adds the
unsharded gradients, 4 bytes/trainable parameter in fp32), activations (Korthikanti et al. 2022,
34 bytes x seq x batch x hidden per layer with flash/SDPA attention; 2 bytes per layer plus one layer's
34 with gradient checkpointing), logits (training.loss_impl=plain: bf16 + fp32 copy + fp32 grad = 10 bytes x
seq x batch x vocab; chunked, the default: one 64 MB chunk of fp32 logits and its gradient),
preference tuning's reference (a frozen copy of the weights for `reference: model`, sharded like the policy;
a micro-batch of pairs is twice the sequences; the reference forward in FLOPs), online RL's rollouts (a
micro-batch is micro_batch_size x num_generations sequences of prompt + completion; the forward passes that
sample them, the old policy's and the reference's log-probs in FLOPs, once per rl.num_iterations steps; their
decoding time only at a decode rate you give, --decode-tokens-per-s: decoding is bound by memory bandwidth, not
by FLOPs, and no MFU describes it), and a 2 GB reserve
(CUDA context, communication buffers). Estimates, not measurements: the recommendation is the cheapest
strategy that fits with 15% of the card to spare (a plan with less is marked "tight" and recommended only
when nothing else fits).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.metrics.flops import (ModelShape, attention_flops_per_token, forward_flops_per_token,
                             training_flops_per_token)
from disttrain.metrics.hardware import ACCELERATORS, Accelerator, lookup

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp", "zero3", "fsdp_offload", "zero3_offload"]
# The meshes, planned when asked for (--hsdp-replicas, --sp, --cp, --tp): which one-dimensional strategy shards
# their states, and over how many GPUs (hsdp: one replica's; Ulysses: ZeRO-3 over all of them, dp x sp;
# context parallelism: FSDP2 over all of them, dp_shard x cp; tensor parallelism alone: every weight matrix
# split over all of them, as FSDP2 would shard it; FSDP2 + TP: split over tp, sharded over the tp groups, so
# again 1/GPUs of every weight, with replicas (hsdp_tp) 1/(GPUs / replicas))
MESHES = {"hsdp": "fsdp", "zero3_ulysses": "zero3", "fsdp_cp": "fsdp", "tp": "fsdp", "fsdp_tp": "fsdp",
          "hsdp_tp": "fsdp", "fsdp_ep": "fsdp", "hsdp_ep": "fsdp", "fsdp_pp": "fsdp"}
# Pipeline parallelism (--pp) shards the states over every GPU too (1/pp of the layers per stage, FSDP2 over the
# stage's GPUS / pp); what it changes is the activations (a stage's layers, for the micro-batches in flight) and
# the schedule's bubble (pipeline_bubble below), which its time includes.
# Expert parallelism (--ep) shards the states as FSDP2 does over the same GPUs (a replica's): the dense weights
# over all of them, each expert whole on one of ep GPUs and sharded over the dp_shard / ep that hold it, so again
# 1/GPUs of everything. What it changes is the traffic: expert_traffic_gb below.
# Assumed MFU per strategy when nothing measured is given (the seed chapter's planning figures; offload
# moves weights over PCIe every step; HSDP's gathers stay inside a node, as FSDP2's on one node; Ulysses adds
# four all-to-alls per layer and pass; the ring exchanges every layer's keys and values, overlapped only in
# part; TP all-reduces activations twice per layer and pass, on the critical path). Replace with --mfu or
# --bench for real planning.
ASSUMED_MFU = {"ddp": 0.40, "zero1": 0.38, "zero2": 0.32, "fsdp": 0.35, "zero3": 0.28,
               "fsdp_offload": 0.12, "zero3_offload": 0.12, "hsdp": 0.35, "zero3_ulysses": 0.25, "fsdp_cp": 0.28,
               "tp": 0.30, "fsdp_tp": 0.30, "hsdp_tp": 0.30,
               # assumed as FSDP2's (the FLOPs are the same): EP's gain is the traffic it saves, shown beside
               "fsdp_ep": 0.35, "hsdp_ep": 0.35,
               # FSDP2's over each stage (the same FLOPs); the bubble is counted apart, in the row's time
               "fsdp_pp": 0.35}
RESERVE_GB = 2.0
REFERENCE_NOTES = {"model": "a frozen copy of the weights in the states",
                   "precomputed": "once over the data (exact for one epoch)",
                   "adapters": "no second copy (the adapters are disabled)"}
USABLE = 0.95  # fraction of the card's memory the allocator can really hand out
# The recommendation wants this much of the card left over: the memory model is an estimate (fragmentation,
# a longer batch, a framework buffer it does not count), and a run that OOMs at step 900 costs more than a
# slower strategy. A plan that only fits without it is still shown, and recommended only when nothing else fits.
HEADROOM = 0.85


@dataclass
class Workload:
    params: float
    shape: ModelShape | None
    tokens: float
    seq_len: int
    micro_batch: int
    gradient_checkpointing: bool
    lora_params: float | None = None      # trainable adapter parameters (None: full fine-tune)
    weight_bytes: float = 2.0             # frozen base weights under LoRA: 2 bf16, 0.5 for 4-bit
    # FSDP with distributed.fsdp_sync_each_micro_batch=false and grad_accum > 1: every layer's gradient stays
    # unsharded between micro-batches (4 bytes/trainable parameter when reduced in fp32, else 2), per GPU
    fsdp_unsharded_grad_bytes: float = 0.0
    loss_impl: str = "chunked"           # training.loss_impl: how much memory the logits take
    # preference tuning's reference (Recipe.reference_mode): "model" holds a frozen copy of the weights, sharded
    # like the policy; "adapters" and "model" run one more forward per step, "precomputed" one over the data
    reference: str = "none"
    # online RL (training.objective: grpo): forward passes per trained token made for the rollouts (sampling, the
    # old policy's and the reference's log-probs, once per rl.num_iterations steps), generated tokens per trained
    # token, and the decode rate per GPU to time the sampling at (None: not timed)
    rollout_forwards: float = 0.0
    generated_share: float = 0.0
    decode_tokens_per_s: float | None = None
    # online RL: completions sampled per generate() call on a GPU and tokens per row (prompt + completion): the
    # KV cache of a rollout
    rollout_rows: int = 0
    rollout_tokens: int = 0
    routing: tuple[int, int] | None = None  # mixture of experts: (experts per block, experts per token)
    # distillation (training.objective: distill): the frozen teacher's parameters (held like a DPO reference copy,
    # in its dtype's bytes) and its forward FLOPs per trained token
    teacher_params: float = 0.0
    teacher_weight_bytes: float = 2.0
    teacher_flops_per_token: float = 0.0
    grad_accum: int = 1  # micro-batches per optimizer step: a pipeline's schedule runs them through its stages


def _fsdp_no_sync_gb(w: Workload, strategy: str) -> float:
    trainable = w.params if w.lora_params is None else w.lora_params
    return w.fsdp_unsharded_grad_bytes * trainable / 1e9 if strategy.startswith("fsdp") else 0.0


def model_states_gb(w: Workload, strategy: str, n: int) -> tuple[float, float]:
    """(GPU GB, host GB) for weights + gradients + optimizer states of one GPU."""
    gpu, host = _sharded_states_gb(w, strategy, n)
    ref_gpu, ref_host = _reference_copy_gb(w, strategy, n)
    teacher_gpu, teacher_host = _frozen_copy_gb(w.teacher_weight_bytes * w.teacher_params / 1e9, strategy, n)
    return gpu + _fsdp_no_sync_gb(w, strategy) + ref_gpu + teacher_gpu, host + ref_host + teacher_host


def _reference_copy_gb(w: Workload, strategy: str, n: int) -> tuple[float, float]:
    """preference.reference: model -- a frozen copy in the recipe's dtype, prepared like the policy."""
    if w.reference != "model":
        return 0.0, 0.0
    return _frozen_copy_gb(w.weight_bytes * w.params / 1e9, strategy, n)


def _frozen_copy_gb(weights: float, strategy: str, n: int) -> tuple[float, float]:
    """(GPU GB, host GB) of a frozen model of `weights` GB prepared like the policy (a reference, a teacher):
    whole on every GPU under DDP and ZeRO-1/2 (they shard no frozen weights), sharded under FSDP2 / ZeRO-3, in
    host RAM when those offload."""
    if strategy in ("ddp", "zero1", "zero2"):
        return weights, 0.0
    if strategy in ("fsdp", "zero3"):
        return weights / n, 0.0
    return 0.0, weights


def _sharded_states_gb(w: Workload, strategy: str, n: int) -> tuple[float, float]:
    p = w.params
    if w.lora_params is None:
        per_gpu = {"ddp": 16 * p, "zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n,
                   "fsdp": 16 * p / n, "zero3": 16 * p / n}
        if strategy in per_gpu:
            return per_gpu[strategy] / 1e9, 0.0
        layer = 2 * p / (w.shape.layers if w.shape else 32)  # bf16 weights of one layer
        return 2 * layer / 1e9, 16 * p / 1e9                 # two layers in flight; all states in host RAM
    base = w.weight_bytes * p
    adapters = 16 * w.lora_params
    if strategy in ("ddp", "zero1", "zero2"):
        return (base + adapters) / 1e9, 0.0                  # ZeRO-1/2 never shard frozen weights
    if strategy in ("fsdp", "zero3"):
        return (base + adapters) / n / 1e9, 0.0
    return 2 * base / (w.shape.layers if w.shape else 32) / 1e9, (base + adapters) / 1e9


def activations_gb(w: Workload, sp: int = 1, tp: int = 1) -> float | None:
    """Per GPU. Ulysses (sp processes per sequence) keeps 1/sp of every sequence's positions outside attention
    and all positions of 1/sp of the heads inside it; the ring (cp, passed as `sp`) 1/cp of the positions
    everywhere: every term but the chunked loss's fixed chunk falls by sp. Tensor parallelism (tp) splits what
    attention and the MLP keep (24 of the 34 bytes per token and hidden unit) and replicates the rest (the
    norms' and residual's 10: Korthikanti et al. 2022, without sequence parallelism)."""
    if w.shape is None:
        return None
    tokens = w.seq_len * w.micro_batch // sp
    per_layer_full = (10 + 24 / tp) * tokens * w.shape.hidden
    if w.gradient_checkpointing:
        layers = 2 * tokens * w.shape.hidden * w.shape.layers + per_layer_full
    else:
        layers = per_layer_full * w.shape.layers
    return (layers + logits_bytes(w, tokens)) / 1e9


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """The share of a step each stage idles under GPipe and 1F1B: (p - 1) / (m + p - 1) (GPipe paper, Huang et al.
    2019; 1F1B has the same bubble and holds fewer activations, Narayanan et al. 2021)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_activations_gb(w: Workload, stages: int) -> float | None:
    """Per GPU under 1F1B: the first stage holds its 1/stages of the layers for min(stages, grad_accum) micro-batches
    in flight (GPipe would hold all grad_accum of them)."""
    whole = activations_gb(w)
    return None if whole is None else whole * min(stages, w.grad_accum) / stages


def logits_bytes(w: Workload, tokens: int) -> float:
    """plain: bf16 logits + their fp32 copy + its gradient for every token (10 bytes x vocab); chunked
    (disttrain/objectives/token_loss.py): one chunk's fp32 logits and their gradient, whatever the sequence;
    trl (TRL's fused head): its one [4096 tokens x 32768 vocab] tile in bf16, reused for every tile."""
    if w.loss_impl == "plain":
        return 10.0 * tokens * w.shape.vocab
    if w.loss_impl == "trl":
        return 2.0 * min(4096, tokens) * min(32768, w.shape.vocab)
    from disttrain.objectives.token_loss import CHUNK_LOGITS

    return 8.0 * min(CHUNK_LOGITS, tokens * w.shape.vocab)


def flops_per_token(w: Workload) -> float:
    return (_training_flops_per_token(w) + reference_flops_per_token(w) + rollout_flops_per_token(w)
            + w.teacher_flops_per_token)


def rollout_flops_per_token(w: Workload) -> float:
    """Online RL: the rollouts' forward passes per trained token (sampling with the KV cache costs about one
    forward per token; the old policy's and the reference's log-probs one each)."""
    if not w.rollout_forwards:
        return 0.0
    forward = 2.0 * w.params if w.shape is None else forward_flops_per_token(w.shape, w.seq_len)
    return w.rollout_forwards * forward


def _training_flops_per_token(w: Workload) -> float:
    if w.shape is None:  # only a parameter count: 6N, no attention term
        return (6.0 if w.lora_params is None else 4.0) * w.params + 6.0 * (w.lora_params or 0)
    return training_flops_per_token(w.shape, w.seq_len, None if w.lora_params is None else int(w.lora_params))


def reference_flops_per_token(w: Workload) -> float:
    """Preference tuning's reference forward (2 FLOPs/weight/token and a third of the attention term, as
    throughput.FlopsMeter counts a live one): every step for adapters/model; once over the data when
    precomputed, counted per training token (exact for one epoch, an upper bound for more)."""
    if w.reference == "none" or w.rollout_forwards:  # online RL counts its reference among the rollouts' passes
        return 0.0
    return 2.0 * w.params if w.shape is None else forward_flops_per_token(w.shape, w.seq_len)


def expert_traffic_gb(w: Workload, n_gpus: int, ep: int, hsdp_replicas: int = 1) -> dict[str, float] | None:
    """Per GPU and micro-batch, the experts' traffic (bf16 weights and activations; fp32 gradient reductions):
    FSDP2 / ZeRO-3 gather every expert's weights for the forward and again for the backward (and the recompute,
    with gradient checkpointing), and reduce-scatter their gradients in full fine-tuning; expert parallelism sends
    each token's hidden state to its k experts and back, forward and backward (and again in the recompute), to the
    (ep - 1) / ep of them on other GPUs, and gathers and reduces only over the dp_shard / ep GPUs holding the same
    experts. None without a mixture of experts."""
    if w.shape is None or not w.shape.expert_params or w.routing is None:
        return None
    shards = n_gpus // hsdp_replicas
    passes = 2 + w.gradient_checkpointing  # weight gathers per micro-batch; token exchanges: twice as many
    experts, trained = w.shape.expert_params, w.lora_params is None

    def sharded(count: float, over: int) -> float:
        return (passes * 2 * count + 4 * count * trained) * (over - 1) / over / 1e9 if over > 1 else 0.0
    tokens = w.seq_len * w.micro_batch
    exchange = 2 * passes * tokens * w.routing[1] * w.shape.hidden * 2 * w.shape.layers * (ep - 1) / ep / 1e9
    return {"fsdp_gb": sharded(experts, shards), "ep_tokens_gb": exchange,
            "ep_gather_gb": sharded(experts / ep, shards // ep), "row": "hsdp_ep" if hsdp_replicas > 1 else "fsdp_ep"}


def _mesh_rows(n_gpus: int, hsdp_replicas: int, sp: int, cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1
               ) -> list[tuple[str, str, int, int, int]]:
    """(row, strategy sharding its states, GPUs they are sharded over, sequence-parallel size, tensor-parallel
    size) per row."""
    rows = [(s, s, n_gpus, 1, 1) for s in STRATEGIES]
    if hsdp_replicas > 1:
        if n_gpus % hsdp_replicas:
            raise DisttrainError(f"--hsdp-replicas {hsdp_replicas} must divide --gpus {n_gpus}")
        rows.append(("hsdp", MESHES["hsdp"], n_gpus // hsdp_replicas, 1, 1))
    if sp > 1:
        if n_gpus % sp:
            raise DisttrainError(f"--sp {sp} must divide --gpus {n_gpus}")
        rows.append(("zero3_ulysses", MESHES["zero3_ulysses"], n_gpus, sp, 1))
    if cp > 1:
        if n_gpus % cp:
            raise DisttrainError(f"--cp {cp} must divide --gpus {n_gpus}")
        rows.append(("fsdp_cp", MESHES["fsdp_cp"], n_gpus, cp, 1))
    if tp > 1:
        if n_gpus % tp or (tp < n_gpus and n_gpus % (tp * hsdp_replicas)):
            raise DisttrainError(f"--tp {tp} must divide --gpus {n_gpus} (with --hsdp-replicas {hsdp_replicas}: "
                                 f"{tp} x {hsdp_replicas} must): tensor parallelism runs alone (tp = GPUs) or in "
                                 "groups under FSDP2")
        if tp == n_gpus:
            rows.append(("tp", MESHES["tp"], n_gpus, 1, tp))
        else:
            rows.append(("fsdp_tp", MESHES["fsdp_tp"], n_gpus, 1, tp))
            if hsdp_replicas > 1:
                rows.append(("hsdp_tp", MESHES["hsdp_tp"], n_gpus // hsdp_replicas, 1, tp))
    if ep > 1:
        if n_gpus % hsdp_replicas or (n_gpus // hsdp_replicas) % ep:
            raise DisttrainError(f"--ep {ep} must divide the GPUs of a replica (--gpus {n_gpus} / --hsdp-replicas "
                                 f"{hsdp_replicas})")
        rows.append(("fsdp_ep", MESHES["fsdp_ep"], n_gpus, 1, 1))
        if hsdp_replicas > 1:
            rows.append(("hsdp_ep", MESHES["hsdp_ep"], n_gpus // hsdp_replicas, 1, 1))
    if pp > 1:
        if n_gpus % pp:
            raise DisttrainError(f"--pp {pp} must divide --gpus {n_gpus} (pp stages, each over GPUS / pp GPUs)")
        rows.append(("fsdp_pp", MESHES["fsdp_pp"], n_gpus, 1, 1))
    return rows


def plan(w: Workload, gpu: Accelerator, n_gpus: int, price: float, mfu: dict[str, float],
         mfu_source: dict[str, str], host_ram_gb: float | None, hsdp_replicas: int = 1, sp: int = 1,
         cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1) -> dict:
    total_flops = flops_per_token(w) * w.tokens
    rows = []
    for strategy, sharding, shards, seq_shards, tensor_shards in _mesh_rows(n_gpus, hsdp_replicas, sp, cp, tp, ep,
                                                                            pp):
        states, host = model_states_gb(w, sharding, shards)
        staged = strategy == "fsdp_pp"
        act = pipeline_activations_gb(w, pp) if staged else activations_gb(w, seq_shards, tensor_shards)
        need = states + (act or 0.0) + RESERVE_GB
        fits = need <= gpu.memory_gb * USABLE and (host_ram_gb is None or host <= host_ram_gb)
        tight = fits and need > gpu.memory_gb * HEADROOM
        seconds = total_flops / (n_gpus * gpu.peak_tflops * 1e12 * mfu[strategy])
        if staged:  # every stage idles for the bubble's share of each step
            seconds /= 1 - pipeline_bubble(pp, w.grad_accum)
        if w.decode_tokens_per_s:  # online RL: the sampling at the decode rate given
            seconds += w.tokens * w.generated_share / (n_gpus * w.decode_tokens_per_s)
        hours = seconds / 3600
        rows.append({"strategy": strategy, "states_gb": states, "activations_gb": act, "need_gb": need,
                     "host_ram_gb": host, "fits": fits, "tight": tight, "mfu": mfu[strategy],
                     "mfu_source": mfu_source[strategy],
                     "hours": hours, "gpu_hours": hours * n_gpus, "cost": hours * n_gpus * price})
    fitting = [r for r in rows if r["fits"] and not r["tight"]] or [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["cost"])["strategy"] if fitting else None
    return {"flops_per_token": flops_per_token(w), "total_flops": total_flops, "gpu": asdict(gpu), "gpus": n_gpus,
            "price_per_gpu_hour": price, "rows": rows, "recommended": best, "ep": ep, "pp": pp,
            "expert_traffic": expert_traffic_gb(w, n_gpus, ep, hsdp_replicas) if ep > 1 else None}


# ---------------------------------------------------------------- inputs
def _workload_from_args(args) -> tuple[Workload, str]:
    shape = None
    lora = None
    weight_bytes, no_sync_bytes, loss_impl, reference, rollout, teacher = 2.0, 0.0, "chunked", "none", {}, {}
    seq_len, micro, ckpt = args.seq_len or 2048, args.micro_batch or 1, args.gradient_checkpointing
    accumulation = getattr(args, "grad_accum", None) or 1
    title, multi_turn = "", ""
    if args.recipe or args.config:
        from transformers import AutoConfig

        from disttrain.metrics.flops import shape_from_config
        from disttrain.tools.preflight import find_config_dir

        name = args.config
        if args.recipe:
            from disttrain.recipe.schema import load_recipe

            recipe = load_recipe(args.recipe)
            name = recipe.model.name_or_path
            seq_len = args.seq_len or recipe.data.max_seq_len
            micro = args.micro_batch or recipe.training.micro_batch_size
            accumulation = getattr(args, "grad_accum", None) or recipe.training.grad_accum
            if recipe.training.objective == "dpo":
                reference = recipe.reference_mode()
                if not args.micro_batch:
                    micro *= 2  # a micro-batch of pairs runs chosen and rejected: twice the sequences
            rollout = _rollout(recipe, args) if recipe.training.objective == "grpo" else {}
            if recipe.training.objective == "distill":
                teacher = _teacher(recipe)
            if rollout:
                reference = recipe.rl_reference()
                seq_len, micro = args.seq_len or rollout.pop("seq_len"), args.micro_batch or rollout.pop("micro")
                if recipe.rl.agentic():  # the same bound: a whole trajectory, its tools' replies included
                    turns = recipe.rl.max_tool_calling_iterations
                    multi_turn = (f", multi-turn with tools: a trajectory of at most {recipe.rl.max_completion_length}"
                                  " tokens, the tools' replies included (prefilled, not sampled: the generated share "
                                  f"is an upper bound), {turns + 1 if turns else 'unbounded'} turns at most")
            ckpt = ckpt or recipe.model.gradient_checkpointing
            weight_bytes = 0.5 if recipe.model.quantization else (4.0 if recipe.model.dtype == "float32" else 2.0)
            loss_impl = recipe.training.loss_impl
            if recipe.lora is not None:
                lora = (recipe.lora.r, recipe.lora.target_modules, recipe.lora.target_parameters)
            if not recipe.distributed.fsdp_sync_each_micro_batch and recipe.training.grad_accum > 1:
                no_sync_bytes = 4.0 if recipe.distributed.fsdp_reduce_in_fp32 else 2.0
        config = AutoConfig.from_pretrained(find_config_dir(name))
        shape = shape_from_config(config)
        params = shape.params
        title = name
    elif args.params:
        params = args.params
        title = f"{params / 1e9:.1f}B-parameter model"
    else:
        raise DisttrainError("give --recipe, --config (a model with a shipped config) or --params")
    routing = None
    if args.recipe or args.config:
        from disttrain.model.family import Family

        routing = Family.of(config).routing
    lora_params = None
    if lora is not None:
        lora_params = _lora_params(config, *lora)
        title += f", LoRA r={lora[0]} ({lora_params / 1e6:.1f}M trainable)"
    elif args.lora_params:
        lora_params = args.lora_params
        title += f", LoRA ({lora_params / 1e6:.1f}M trainable)"
    if reference != "none":
        title += f", {'GRPO' if rollout else 'DPO'} reference: {reference}"
    if teacher:
        teacher["teacher_flops_per_token"] += teacher.pop("lmbda") * forward_flops_per_token(shape, seq_len)
        title += f", teacher {teacher.pop('name')} ({teacher['teacher_params'] / 1e9:.1f}B, frozen)"
    title += multi_turn
    rollout = {k: v for k, v in rollout.items() if k in ("rollout_forwards", "generated_share",
                                                         "decode_tokens_per_s", "rollout_rows", "rollout_tokens")}
    return Workload(params, shape, args.tokens, seq_len, micro, ckpt, lora_params, weight_bytes,
                    no_sync_bytes, loss_impl, reference, **rollout, routing=routing, **teacher,
                    grad_accum=accumulation), title


SHARDED = ("fsdp", "fsdp_offload", "hsdp", "zero3", "zero3_offload")  # the rows whose rollouts may gather


def rollout_weights_lines(w: Workload, result: dict) -> list[str]:
    """Online RL under FSDP2 / ZeRO-3: whether a rollout gathers the whole model once (rl.generation_weights: auto,
    runtime/rollout_weights.py) -- the model in bf16 plus the rollout's KV cache within 90% of what a GPU has left
    beside the strategy's need -- or each layer for every generated token."""
    if not w.rollout_rows or w.shape is None:
        return []
    from disttrain.runtime.rollout_weights import HEADROOM

    whole = w.params * 2 / 1e9
    shape = w.shape
    heads = shape.kv_heads or shape.heads
    kv = 2 * shape.layers * heads * shape.head_dim * w.rollout_rows * w.rollout_tokens * 2 / 1e9
    memory = result["gpu"]["memory_gb"]
    verdicts = [f"{r['strategy']} {'whole' if whole + kv <= HEADROOM * (memory - r['need_gb']) else 'per layer'}"
                for r in result["rows"] if r["strategy"] in SHARDED]
    return [f"Rollouts (rl.generation_weights: auto): the whole model ({whole:.1f} GB in bf16) + the KV cache of "
            f"{w.rollout_rows} rows x {w.rollout_tokens} tokens ({kv:.1f} GB) gathered once per rollout if within "
            f"{HEADROOM:.0%} of what a GPU has left, else each layer per generated token: {', '.join(verdicts)} "
            "(docs/rl.md)."] if verdicts else []


def _rollout(recipe, args) -> dict:
    """Online RL's shape: sequences of prompt + completion, num_generations of them per prompt, the rollouts'
    forward passes and generated tokens per trained token."""
    rl = recipe.rl
    seq_len = recipe.data.max_seq_len + rl.max_completion_length
    passes = 1 + (rl.num_iterations > 1) + (recipe.rl_reference() != "none")
    rows = recipe.training.micro_batch_size * recipe.training.grad_accum * rl.num_generations  # a step's, a GPU
    return {"seq_len": seq_len, "micro": recipe.training.micro_batch_size * rl.num_generations,
            "rollout_rows": min(rows, rl.rows_per_generate or rows), "rollout_tokens": seq_len,
            "rollout_forwards": passes / rl.num_iterations,
            "generated_share": rl.max_completion_length / seq_len / rl.num_iterations,
            "decode_tokens_per_s": args.decode_tokens_per_s}


def _teacher(recipe) -> dict:
    """Distillation's teacher, from its shipped config: its parameters, its bytes per weight, its forward per
    trained token; the student's on-policy sampling (about one forward per generated token on lmbda of the steps)
    is added by the caller, who knows the student's shape."""
    from transformers import AutoConfig

    from disttrain.metrics.flops import shape_from_config
    from disttrain.tools.preflight import find_config_dir

    d = recipe.distill
    shape = shape_from_config(AutoConfig.from_pretrained(find_config_dir(d.teacher)))
    dtype = d.teacher_dtype or recipe.model.dtype
    return {"name": d.teacher, "teacher_params": shape.params,
            "teacher_weight_bytes": 4.0 if dtype == "float32" else 2.0,
            "teacher_flops_per_token": forward_flops_per_token(shape, recipe.data.max_seq_len), "lmbda": d.lmbda}


def workload_from_recipe(recipe_path: str) -> tuple[Workload, str]:
    """The recipe's model (from its shipped config.json), LoRA and sequence settings; no token count."""
    import argparse

    return _workload_from_args(argparse.Namespace(recipe=recipe_path, config=None, params=None, lora_params=None,
                                                  tokens=0.0, seq_len=None, micro_batch=None,
                                                  gradient_checkpointing=False, decode_tokens_per_s=None))


def _lora_params(config, r: int, targets, parameters=None) -> int:
    """r x (in + out) for every targeted Linear ("all-linear" = all but the output projection); for a targeted
    parameter (an MoE block's fused experts, [E, out, in]) peft adds one r-rank pair per expert: r x E x (in + out)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        if targets == "all-linear" or name.split(".")[-1] in targets:
            total += r * (module.in_features + module.out_features)
    for name, param in model.named_parameters():
        if parameters and param.dim() == 3 and any(name.endswith(t) for t in parameters):
            experts, out, inp = param.shape
            total += r * experts * (out + inp)
    return total


def _mfu(args) -> tuple[dict, dict]:
    mfu, source = dict(ASSUMED_MFU), {s: "assumed" for s in ASSUMED_MFU}
    if args.bench:
        results = json.loads(Path(args.bench).read_text())
        for row in results.get("results", []):
            name = row["strategy"].replace("-", "_")
            if name in mfu and row.get("mfu"):
                mfu[name], source[name] = float(row["mfu"]), f"measured ({Path(args.bench).name})"
    if args.mfu:
        for s in ASSUMED_MFU:
            mfu[s], source[s] = args.mfu, "given"
    return mfu, source


# ---------------------------------------------------------------- output
def _fmt_hours(h: float) -> str:
    return f"{h:,.1f} h" if h < 48 else f"{h / 24:,.1f} days"


def render(result: dict, title: str, w: Workload, chosen: str | None) -> str:
    gpu = result["gpu"]
    lines = [
        f"Plan: {title}",
        f"  {w.params / 1e9:.2f}B parameters, {w.tokens:.3g} tokens"
        + (f", seq {w.seq_len} x micro-batch {w.micro_batch}"
           f"{', gradient checkpointing' if w.gradient_checkpointing else ''}" if w.shape else ""),
        *([f"  mixture of experts: {w.shape.matmul_params / 1e9:.2f}B matmul parameters active per token (the "
           f"top-k share of {w.shape.expert_params / 1e9:.2f}B expert weights, + attention, router, head): FLOPs "
           f"count those; memory counts all {w.params / 1e9:.2f}B"] if w.shape and w.shape.expert_params else []),
        f"  FLOPs/token {result['flops_per_token']:.3g}"
        + (f" (attention {attention_flops_per_token(w.shape, w.seq_len):.3g})" if w.shape else
           " (6N; attention term needs --config/--recipe)")
        + f", total {result['total_flops']:.3g} FLOPs",
        *([f"  DPO reference ({w.reference}): {reference_flops_per_token(w):.3g} FLOPs/token of forward included, "
           + REFERENCE_NOTES[w.reference]] if w.reference != "none" and not w.rollout_forwards else []),
        *([f"  online RL: {w.rollout_forwards:.2g} rollout forward passes per trained token (sampling, old policy, "
           f"reference) = {rollout_flops_per_token(w):.3g} FLOPs/token included; {w.generated_share:.2g} generated "
           "tokens per trained token, "
           + (f"decoded at {w.decode_tokens_per_s:g} tokens/s per GPU (given)" if w.decode_tokens_per_s else
              "their decoding time not included: give --decode-tokens-per-s (a run's rollout_tokens_per_s / GPUs)")]
          if w.rollout_forwards else []),
        f"  {result['gpus']} x {gpu['name']}: {gpu['peak_tflops']:g} TFLOP/s dense bf16, {gpu['memory_gb']:g} GB, "
        f"${result['price_per_gpu_hour']:.2f}/GPU-hour",
        "",
        f"  {'strategy':<14}{'states/GPU':>11}{'activ.':>9}{'need/GPU':>10}{'host RAM':>10}  {'fits':<5}"
        f"{'MFU':>6}  {'(source)':<10}{'time':>12}{'GPU-hours':>12}{'cost':>12}",
    ]
    for r in result["rows"]:
        mark = "*" if r["strategy"] == chosen else " "
        act = f"{r['activations_gb']:.1f}" if r["activations_gb"] is not None else "?"
        lines.append(
            f"{mark} {r['strategy']:<14}{r['states_gb']:>9.1f}GB{act:>7}GB{r['need_gb']:>8.1f}GB"
            f"{r['host_ram_gb']:>8.0f}GB  {('tight' if r['tight'] else 'yes') if r['fits'] else 'NO':<5}"
            f"{r['mfu']:>6.0%}  {r['mfu_source']:<10}"
            f"{_fmt_hours(r['hours']):>12}{r['gpu_hours']:>12,.0f}{'$' + format(r['cost'], ',.0f'):>12}")
    lines.append("")
    lines += rollout_weights_lines(w, result)
    traffic = result.get("expert_traffic")
    if traffic:
        lines.append(f"Experts' traffic per GPU and micro-batch: FSDP2 / ZeRO-3 gather (and reduce) "
                     f"{traffic['fsdp_gb']:.2f} GB of expert weights; EP {result['ep']} ({traffic['row']}) sends "
                     f"{traffic['ep_tokens_gb']:.2f} GB of tokens by all-to-all"
                     + (f" and gathers {traffic['ep_gather_gb']:.2f} GB over the GPUs holding the same experts"
                        if traffic["ep_gather_gb"] else "")
                     + " (EP's states per GPU equal FSDP2's: it saves traffic, not memory; docs/expert_parallel.md).")
    elif result.get("ep", 1) > 1:
        lines.append("--ep: the model is not a mixture of experts (or has no shape): no expert traffic to compare.")
    if result.get("pp", 1) > 1:
        pp, m = result["pp"], w.grad_accum
        lines.append(f"fsdp_pp: {pp} stages, {m} micro-batches per step (training.grad_accum): the bubble idles "
                     f"{pipeline_bubble(pp, m):.0%} of each step ((p - 1) / (m + p - 1)), included in its time; its "
                     f"activations are 1/{pp} of the layers for {min(pp, m)} micro-batches in flight (1F1B). Raise "
                     "grad_accum to shrink the bubble (docs/strategies.md, 'Pipeline parallelism').")
    if w.shape is None:
        lines.append("Activations not included (no model shape): add --config or --recipe for them.")
    if chosen:
        row = next(r for r in result["rows"] if r["strategy"] == chosen)
        lines.append(f"{chosen}: {('fits, tightly' if row['tight'] else 'fits') if row['fits'] else 'DOES NOT FIT'} "
                     f"({row['need_gb']:.1f} GB needed of {gpu['memory_gb']:g} GB per GPU), "
                     f"{_fmt_hours(row['hours'])}, ${row['cost']:,.0f}")
    if result["recommended"]:
        best = next(r for r in result["rows"] if r["strategy"] == result["recommended"])
        spare = f"{1 - HEADROOM:.0%} of the card"
        lines.append(f"Recommended: {result['recommended']} — the cheapest strategy that fits "
                     + (f"with {spare} to spare" if not best["tight"] else
                        f"(tightly: less than {spare} to spare, and nothing fits with more)")
                     + " (same GPUs, so cheapest = fastest at the MFU shown).")
    else:
        lines.append("Nothing fits: use more or larger GPUs, LoRA/QLoRA, gradient checkpointing or a shorter "
                     "sequence.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("model")
    src.add_argument("--recipe", help="count parameters (and LoRA, seq, batch) from a recipe")
    src.add_argument("--config", help="a model name with a shipped config (model_configs/) or a local model dir")
    src.add_argument("--params", type=float, help="parameter count, when no config is at hand (e.g. 7e9)")
    src.add_argument("--lora-params", type=float, help="trainable adapter parameters (with --params)")
    parser.add_argument("--tokens", type=float, required=True, help="training tokens (e.g. 100e9)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpu", default="H100", help=f"one of: {', '.join(ACCELERATORS)}")
    hw.add_argument("--gpus", type=int, default=8, help="GPUs in all")
    hw.add_argument("--price", type=float, help="USD per GPU-hour (default: the table's round figure)")
    hw.add_argument("--peak-tflops", type=float, help="override the dense peak")
    hw.add_argument("--memory-gb", type=float, help="override the memory per GPU")
    hw.add_argument("--host-ram-gb", type=float, help="host RAM for offload (per job); unknown if omitted")
    hw.add_argument("--hsdp-replicas", type=int, default=1,
                    help="add an hsdp row: FSDP2 sharded within GPUS / R GPUs, replicated R times (R = nodes)")
    hw.add_argument("--sp", type=int, default=1,
                    help="add a zero3_ulysses row: each sequence split over SP GPUs (activations / SP)")
    hw.add_argument("--cp", type=int, default=1,
                    help="add an fsdp_cp row: each sequence split over CP GPUs around the ring (activations / CP)")
    hw.add_argument("--tp", type=int, default=1,
                    help="add a tp row (TP = GPUS: tensor parallelism alone) or fsdp_tp (and, with --hsdp-replicas, "
                         "hsdp_tp) rows (TP < GPUS: groups of TP GPUs under FSDP2): weights and part of the "
                         "activations / TP")
    hw.add_argument("--pp", type=int, default=1,
                    help="add an fsdp_pp row: the layers cut into PP stages, FSDP2 over each stage's GPUS / PP; "
                         "its time includes the schedule's bubble over --grad-accum (or the recipe's) micro-batches")
    hw.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default: the recipe's, or 1)")
    hw.add_argument("--ep", type=int, default=1,
                    help="add fsdp_ep (and, with --hsdp-replicas, hsdp_ep) rows: a mixture of experts' experts split "
                         "over EP GPUs of each replica, FSDP2 over the rest; and the experts' traffic it saves")
    parser.add_argument("--strategy", choices=[*STRATEGIES, *MESHES],
                        help="the strategy you plan to use (marked *)")
    parser.add_argument("--mfu", type=float, help="MFU to assume for every strategy (0-1)")
    parser.add_argument("--decode-tokens-per-s", type=float,
                        help="online RL: completion tokens each GPU samples per second (a run's rollout_tokens_per_s "
                             "/ GPUs), to time the rollouts")
    parser.add_argument("--bench", help="bench/results.json from `make bench`: its measured MFU per strategy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    try:
        gpu = lookup(args.gpu)
    except KeyError as exc:
        if not (args.peak_tflops and args.memory_gb):
            raise DisttrainError(str(exc.args[0])) from None
        gpu = Accelerator(args.gpu, args.memory_gb, args.peak_tflops, args.price or 0.0)
    gpu = Accelerator(gpu.name, args.memory_gb or gpu.memory_gb, args.peak_tflops or gpu.peak_tflops,
                      args.price if args.price is not None else gpu.price_per_hour)
    workload, title = _workload_from_args(args)
    mfu, source = _mfu(args)
    result = plan(workload, gpu, args.gpus, gpu.price_per_hour, mfu, source, args.host_ram_gb, args.hsdp_replicas,
                  args.sp, args.cp, args.tp, args.ep, args.pp)
    if args.json:
        print(json.dumps({**result, "model": title, "chosen": args.strategy}, indent=1))
    else:
        print(render(result, title, workload, args.strategy))


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

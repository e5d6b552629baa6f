"""What each mesh refuses, in one line, before any weight loads: of the recipe (sequence and context
parallelism's data, objective, kernels; tensor parallelism's features) and of the model's config (windowed
attention or a router loss across a cut sequence; a tensor-parallel plan, divisible heads, untied embeddings
under FSDP2 + TP). ParallelPlan.check_recipe / check_model call them with the launch's sizes."""

from __future__ import annotations

import os

from disttrain.errors import DisttrainError
from disttrain.model.family import Family
from disttrain.recipe.compat import ALLOW_UNVERIFIED
from disttrain.recipe.schema import Recipe


def check_sequence_parallel(recipe: Recipe, sp: int, cp: int = 1) -> None:
    """Ulysses (sp processes per sequence) and context parallelism (cp) attend causally with no mask and feed
    plain padded rows (data.collation.SequenceShard, ContextShard); Ulysses on the attention kernel the accelerate
    config names, the ring on sdpa."""
    if sp == 1 and cp == 1:
        return
    d, m = recipe.data, recipe.model
    where, name, plain = (("accelerate_configs/zero3_ulysses.yaml (sp_size > 1)", "Ulysses", "zero3.yaml") if sp > 1
                          else ("accelerate_configs/fsdp_cp.yaml (cp_size > 1)", "the attention ring", "fsdp.yaml"))
    if d.packing or d.chunk_isolate_documents:
        raise DisttrainError(f"data.{'packing' if d.packing else 'chunk_isolate_documents'}=true is not supported "
                             f"under {where}: {name} drops the attention mask, so packed examples would attend to "
                             "each other; set it to false (long rows need no packing)")
    if d.streaming:
        raise DisttrainError(f"data.streaming=true is not supported under {where} yet (streams are packed); use a "
                             "map-style dataset (data.streaming=false)")
    if recipe.training.objective != "sft":
        raise DisttrainError(f"training.objective={recipe.training.objective} is not supported under {where} "
                             f"yet; train it without sequence parallelism ({plain})")
    if recipe.lora is not None and recipe.lora.target_parameters:
        raise DisttrainError(f"lora.target_parameters (LoRA on fused experts) is not supported under {where} yet "
                             f"(unverified: the mixture-of-experts recipes are proven without it); train it under "
                             f"{plain}")
    if cp > 1:
        if m.attn_implementation != "sdpa":
            raise DisttrainError(f"model.attn_implementation={m.attn_implementation} is not supported under {where}: "
                                 "torch's ring attention replaces sdpa's kernels only; set it to sdpa")
        return
    kernel = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "sdpa")
    if m.attn_implementation != kernel:
        raise DisttrainError(f"model.attn_implementation={m.attn_implementation} differs from the accelerate "
                             f"config's parallelism_config_sp_attn_implementation={kernel}; Ulysses wraps the "
                             "config's kernel, so set both to the same (sdpa)")
    if kernel != "sdpa" and os.environ.get(ALLOW_UNVERIFIED) != "1":
        raise DisttrainError(f"Ulysses with attn_implementation={kernel} is unverified here (only sdpa is tested); "
                             f"use sdpa, or set {ALLOW_UNVERIFIED}=1 to try it")


def check_ring_kernel(cp: int, gpu: bool) -> None:
    """torch's ring attention maps only its CUDA attention kernels to their ring versions; on a CPU, sdpa's CPU
    kernel is unknown to it and the first forward ends in a NotImplementedError deep in torch, unless the
    project's test-only CPU mapping (tests/cpu_ring, which preflight and bench-long put on PYTHONPATH) is loaded."""
    if cp == 1 or gpu:
        return
    import torch

    try:  # torch's private module: a torch that moved it has no CPU mapping to find
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    except ImportError:
        ring = None
    if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in getattr(ring, "custom_ops", {}):
        raise DisttrainError("accelerate_configs/fsdp_cp.yaml (context parallelism) needs CUDA GPUs: torch's ring "
                             "attention runs only its CUDA attention kernels; on this machine train with fsdp.yaml, "
                             "or try the mesh with `make preflight STRATEGY=fsdp_cp` (it loads the project's "
                             "test-only CPU kernel mapping, tests/cpu_ring)")


def check_sequence_model(config, sp: int, cp: int) -> None:
    """What only the model's config says (read before any weight: check_model_config): both meshes
    attend with full causal attention only (no mask travels with the slices), and the router's load-balancing
    loss of a mixture of experts would be computed per slice, not over the sequence (it is not additive over
    positions), so it would differ from one process's."""
    _check_sequence_family(Family.of(config), sp, cp)


def _check_sequence_family(family: Family, sp: int, cp: int) -> None:
    if sp == 1 and cp == 1:
        return
    where = "accelerate_configs/zero3_ulysses.yaml (sp_size > 1)" if sp > 1 else "accelerate_configs/fsdp_cp.yaml"
    if family.windowed_layers:
        raise DisttrainError(f"{family.name} has {sorted(family.windowed_layers)} layers: not supported under "
                             f"{where}, which attends with full causal attention only (their window would be "
                             "dropped); train it without sequence parallelism")
    if family.router_loss:
        raise DisttrainError(f"model.router_aux_loss_coef (the router's load-balancing loss) is not supported under "
                             f"{where}: each process would compute it on its slice of the sequence, not on the whole "
                             "sequence as one process does; remove the field, or train without sequence parallelism")


TENSOR_PARALLEL_CONFIGS = "accelerate_configs/tp.yaml or fsdp_tp.yaml"


def check_tensor_parallel(recipe: Recipe, tp: int, data_parallel: int = 1) -> None:
    """Tensor parallelism is verified here for the SFT objective on map-style data, under the chunked and the plain
    loss: full fine-tuning alone and under FSDP2 (`data_parallel` > 1 groups), LoRA alone; the rest is refused,
    not guessed."""
    if tp == 1:
        return
    where = f"tensor parallelism ({TENSOR_PARALLEL_CONFIGS}, tp_size > 1)"
    lora = recipe.lora
    refused = [(lora is not None and data_parallel > 1,
                "a lora section under FSDP2 + TP (peft's adapters come after the FSDP2 transformers applies, which "
                "would not shard or reduce them; LoRA runs under tp.yaml alone)"),
               (recipe.model.quantization is not None, "model.quantization (QLoRA's 4-bit weights on tensor-parallel "
                "layers, unverified here)"),
               (lora is not None and (lora.use_dora or bool(lora.target_parameters) or bool(lora.modules_to_save)),
                "lora.use_dora, lora.target_parameters or lora.modules_to_save (on tensor-parallel layers, "
                "unverified here)"),
               (recipe.training.mixed_precision == "fp16",
                "training.mixed_precision=fp16 (its loss scaler's overflow check must agree across the processes' "
                "shards, unverified here; use bf16)"),
               (recipe.training.optimizer != "adamw", f"training.optimizer={recipe.training.optimizer} (on "
                "tensor-parallel DTensors, unverified here)"),
               (recipe.training.objective != "sft", f"training.objective={recipe.training.objective}"),
               (recipe.data.streaming, "data.streaming=true"),
               (recipe.training.loss_impl == "trl", "training.loss_impl=trl (TRL's fused head reads lm_head whole)"),
               (recipe.training.compile, "training.compile=true")]
    for found, what in refused:
        if found:
            raise DisttrainError(f"{what} is not supported under {where} yet; train it under ddp.yaml, fsdp.yaml or "
                                 "a ZeRO config")


def check_tensor_parallel_model(config, tp: int, data_parallel: int = 1) -> None:
    """What only the model's config says (read before the weights are loaded and split): transformers' plan for
    it, attention and key/value heads that divide over the tp processes (each keeps whole heads), and, under
    FSDP2 + TP (`data_parallel` > 1 groups), separate input and output embeddings."""
    _check_tensor_parallel_family(Family.of(config), tp, data_parallel)


def _check_tensor_parallel_family(family: Family, tp: int, data_parallel: int) -> None:
    if tp == 1:
        return
    where = TENSOR_PARALLEL_CONFIGS
    if not family.tp_plan:
        raise DisttrainError(f"{family.name} has no tensor-parallel plan in transformers (base_model_tp_plan); "
                             f"it cannot train under {where}: use fsdp.yaml or a ZeRO config")
    heads, kv_heads = family.heads, family.kv_heads
    if heads % tp or kv_heads % tp:
        raise DisttrainError(f"{family.name} has {heads} attention and {kv_heads} key/value heads: tensor "
                             f"parallelism over {tp} processes needs both divisible by {tp} (each keeps whole heads); "
                             f"launch {where} with --num_processes / --parallelism_config_tp_size dividing {kv_heads}")
    if data_parallel > 1 and family.tied_embeddings:
        # transformers 5.25 applies FSDP2 before it ties lm_head to the embeddings: they become two FSDP2
        # parameters (embed_tokens grouped with the final norm, lm_head in the root group), and lm_head computes
        # with a copy the optimizer never updates (measured: the losses leave one process's from step 2)
        raise DisttrainError(f"{family.name} ties its input and output embeddings (tie_word_embeddings): "
                             "under FSDP2 + TP (fsdp_tp.yaml) transformers shards the two in separate FSDP2 groups "
                             "and lm_head would train a stale copy; use tp.yaml (tensor parallelism alone) or "
                             "fsdp.yaml")


EXPERT_PARALLEL_CONFIG = "accelerate_configs/fsdp_ep.yaml"
# the MLP's projections: on a mixture of experts peft maps them (and "all-linear") onto the fused experts' weights
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3")


def check_expert_parallel(recipe: Recipe, ep: int) -> None:
    """Expert parallelism is verified here for the SFT objective on map-style data, under the chunked and the plain
    loss, full fine-tuning and LoRA on the layers outside the experts; the rest is refused, not guessed."""
    lora, t = recipe.lora, recipe.training
    refused = [(lora is not None and (lora.use_dora or bool(lora.target_parameters) or bool(lora.modules_to_save)),
                "lora.use_dora, lora.target_parameters or lora.modules_to_save (adapters on split experts or "
                "whole copies of a split layer, unverified here; LoRA on attention trains)"),
               (recipe.model.quantization is not None, "model.quantization (4-bit experts split over processes, "
                "unverified here)"),
               (t.mixed_precision == "fp16", "training.mixed_precision=fp16 (its loss scaler's overflow check must "
                "agree across the processes' expert shards, unverified here; use bf16)"),
               (t.optimizer != "adamw", f"training.optimizer={t.optimizer} (on split experts, unverified here)"),
               (t.objective != "sft", f"training.objective={t.objective}"),
               (recipe.data.streaming, "data.streaming=true"),
               (t.loss_impl == "trl", "training.loss_impl=trl (TRL's fused head reads lm_head whole)"),
               (t.compile, "training.compile=true (the token exchange reads its split sizes on the host)")]
    for found, what in refused:
        if found:
            raise DisttrainError(f"{what} is not supported under expert parallelism ({EXPERT_PARALLEL_CONFIG}, "
                                 f"ep {ep}) yet; train it under fsdp.yaml or a ZeRO config")


def check_pipeline(recipe: Recipe, pp: int) -> None:
    """Pipeline parallelism is verified here for full fine-tuning and plain LoRA with the SFT objective on
    map-style, unpacked data, the chunked loss, in fp32 or bf16, eval sets included; the rest is refused, not
    guessed (each needs the stage cut to carry it: a second model, generation, DoRA's and the experts' adapters)."""
    from disttrain.parallel.pipeline import PIPELINE_CONFIG

    d, t, m, lora = recipe.data, recipe.training, recipe.model, recipe.lora
    refused = [(t.objective != "sft", f"training.objective={t.objective}"),
               (lora is not None and (lora.use_dora or lora.use_rslora or bool(lora.target_parameters)
                                      or bool(lora.modules_to_save)),
                "lora.use_dora, use_rslora, target_parameters or modules_to_save (plain LoRA trains)"),
               (lora is not None and lora.dropout > 0, "lora.dropout > 0 (each stage's masks, unverified)"),
               (m.quantization is not None, "model.quantization"),
               (d.streaming, "data.streaming=true"),
               (d.packing or d.chunk_isolate_documents, "data.packing / data.chunk_isolate_documents (position ids "
                "per packed example)"),
               (bool(recipe.evaluation.tasks), "evaluation.tasks (lm-eval on checkpoints)"),
               (recipe.logging.samples > 0, "logging.samples > 0 (generation: set logging.samples=0)"),
               (t.loss_impl != "chunked", f"training.loss_impl={t.loss_impl}"),
               (t.mixed_precision not in ("no", "bf16"), f"training.mixed_precision={t.mixed_precision}"),
               (t.optimizer != "adamw", f"training.optimizer={t.optimizer}"),
               (t.compile, "training.compile=true"),
               (m.gradient_checkpointing, "model.gradient_checkpointing=true"),
               (t.offload_activations, "training.offload_activations=true"),
               (t.neftune_alpha is not None, "training.neftune_alpha (NEFTune)")]
    if t.pp_schedule == "1f1b" and t.grad_accum < pp:
        raise DisttrainError(f"training.grad_accum={t.grad_accum} gives the pipeline's {pp} stages fewer micro-batches "
                             f"than stages, which 1F1B cannot schedule (and which would leave them idle most of each "
                             f"step): set training.grad_accum to {pp} or more ({4 * pp}+ keeps the bubble under 20 %)")
    for found, what in refused:
        if found:
            raise DisttrainError(f"{what} is not supported under pipeline parallelism ({PIPELINE_CONFIG}, pp {pp}) "
                                 "yet; train it under fsdp.yaml, hsdp.yaml or a ZeRO config")


def check_pipeline_model(recipe: Recipe, pp: int) -> None:
    """What only the model's config says about cutting it into pp stages (pipeline.check_model)."""
    from transformers import AutoConfig

    from disttrain.parallel.pipeline import check_model

    family = Family.of_recipe(recipe.model)  # an unreadable config: its one line
    spec = recipe.model
    config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                        trust_remote_code=spec.trust_remote_code)
    check_model(config, spec.name_or_path, pp, family.router_aux_coef > 0)


def check_expert_parallel_model(recipe: Recipe, ep: int, data: tuple[int, int]) -> None:
    """What only the model's config says about expert parallelism, before any weight: a mixture of experts with
    transformers' expert-parallel plan, experts that divide over the ep processes, separate input and output
    embeddings (transformers' FSDP2 would shard them apart, as under FSDP2 + TP), a text model."""
    family = Family.of_recipe(recipe.model)
    name, where = f"{recipe.model.name_or_path} ({family.name})", EXPERT_PARALLEL_CONFIG
    if not family.moe:
        raise DisttrainError(f"{name} is a dense model: expert parallelism ({where}) splits a mixture of experts' "
                             "experts over processes; use fsdp.yaml (or fsdp_tp.yaml) for it")
    if not family.ep_plan:
        raise DisttrainError(f"{name} has no expert-parallel plan in transformers (base_model_ep_plan with "
                             f"ep_dispatch_experts); it cannot train under {where}: use fsdp.yaml or a ZeRO config")
    experts = family.routing[0]
    if experts % ep:
        raise DisttrainError(f"{name} has {experts} experts per block: expert parallelism over {ep} processes needs "
                             f"them divisible by {ep} (each holds whole experts); make train-fsdp-ep EP=N with N "
                             f"dividing {experts}")
    if family.tied_embeddings and data[0] * data[1] > 1:
        raise DisttrainError(f"{name} ties its input and output embeddings (tie_word_embeddings): under {where} "
                             "transformers shards the two in separate FSDP2 groups and lm_head would train a stale "
                             "copy; use fsdp.yaml")
    if family.vision:
        raise DisttrainError(f"{name} is a vision-language model: expert parallelism for it is unverified here; use "
                             "fsdp.yaml or a ZeRO config")
    targets = recipe.lora.target_modules if recipe.lora is not None else []
    on_experts = [targets] if isinstance(targets, str) else [t for t in targets if t in MLP_PROJECTIONS]
    if on_experts:
        raise DisttrainError(f"lora.target_modules={','.join(on_experts)} on {name}: peft adapts a mixture of "
                             f"experts' fused expert (and router) weights for it, which {where} splits over "
                             "processes (unverified here); name the attention layers, e.g. [q_proj, k_proj, v_proj, "
                             "o_proj]")


def check_model_config(recipe: Recipe, sp: int, cp: int, tp: int, data_parallel: int) -> None:
    """What only the model's config says about the sequence and tensor-parallel meshes and about the recipe's
    vision-language fields, read (config.json only) before any weight: the recipe's router loss switched on as
    loading will switch it on."""
    family = Family.of_recipe(recipe.model)
    check_vision_language(recipe, family, sp * cp * tp > 1)
    _check_sequence_family(family, sp, cp)
    _check_tensor_parallel_family(family, tp, data_parallel)


def check_vision_language(recipe: Recipe, family: Family, splits_rows: bool) -> None:
    """Vision-language fine-tuning is proven for SFT on map-style, unpacked rows under the data-parallel configs
    (DDP, FSDP2, HSDP, ZeRO); what else a recipe asks of a vision-language model (or a text model's freeze list)
    stops here (`splits_rows`: the launch splits sequences or layers: Ulysses, context or tensor parallelism)."""
    m, d, t = recipe.model, recipe.data, recipe.training
    if not family.vision:
        if m.freeze is not None:
            raise DisttrainError(f"model.freeze names parts of a vision-language model; {m.name_or_path} "
                                 f"({family.name}) has no image encoder: remove the field")
        return
    from disttrain.model.parts import PARTS

    refused = [(family.cross_attention_images, "reading images through cross-attention layers "
                "(Llama 3.2 Vision / Mllama: a cross_attention_mask per row and image tiles, which the data path does "
                "not build)"),
               (splits_rows, "Ulysses, context or tensor parallelism (images and 3-D positions across a cut "
                "sequence or split layers, unverified here)"),
               (t.objective != "sft", f"training.objective={t.objective}"),
               (d.packing or d.concat_and_chunk, "data.packing / concat_and_chunk (image rows packed: not proven "
                "exact, e.g. Qwen-VL's 3-D positions restart per image)"),
               (d.streaming, "data.streaming=true"),
               (t.loss_impl == "trl", "training.loss_impl=trl (TRL's fused head on a vision-language forward)"),
               (t.mixed_precision == "fp8", "training.mixed_precision=fp8 (an image encoder's layers in float8, "
                "unverified here)"),
               (m.quantization is not None, "model.quantization (4-bit image encoders, unverified here)"),
               (set(m.freeze or ()) >= set(PARTS), "model.freeze of every part (nothing would train)")]
    for found, what in refused:
        if found:
            raise DisttrainError(f"{what} is not supported for the vision-language model {m.name_or_path} "
                                 f"({family.name}) yet; docs/vlm.md lists what is proven")


def check_before_launch(recipe: Recipe, plan, gpu: bool) -> None:
    """Everything that would stop this recipe under this launch (`plan`: parallel/plan.ParallelPlan), checked before
    the process group exists and before any weight loads (one line each); and the launch-environment warnings
    (restarts, the preemption shutdown timeout)."""
    from disttrain.model import hub
    from disttrain.recipe.compat import check, check_trackers, check_unproven, check_zero3_export
    from disttrain.runtime import fp8, guards

    check(recipe, plan.strategy, gpu)
    fp8.check(recipe, plan.label, gpu)
    plan.check_recipe(recipe, gpu)  # what the mesh refuses (parallel/checks.py)
    check_unproven(recipe, plan.label)
    check_trackers(recipe.logging.report_to)
    hub.check_token(recipe.output.push_to_hub)  # before training, not after it
    check_zero3_export(recipe, plan.strategy)
    plan.check_model(recipe)  # the model's config.json against the mesh, before any weight
    guards.warn_elastic_shared_store()  # torchrun restarts that would reconnect to dead workers
    guards.warn_short_shutdown_timeout()  # a preemption checkpoint the launcher would cut off after 30 s

"""Model and tokenizer in: dtype, attention, gradient checkpointing, quantization, LoRA (peft)."""

from __future__ import annotations

import sys

import torch

from disttrain.errors import DisttrainError
from disttrain.model import lora_init, parts
from disttrain.recipe.schema import DataSection, LoraSection, ModelSection
from disttrain.runtime import fp8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(spec: ModelSection, data: DataSection | None = None):
    """The model's tokenizer; for a vision-language model its processor's, carrying the processor and the
    recipe's image limits (data/vision.py), so the data path and the collator read images with it."""
    from transformers import AutoTokenizer

    from disttrain.model.family import Family

    if Family.of_recipe(spec).vision:
        tokenizer = _processor_tokenizer(spec, data)
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_name_or_path or spec.name_or_path,
                                                  revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels = -100), so reusing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise DisttrainError(f"tokenizer of {spec.name_or_path!r} has no eos_token; set one in its "
                             "tokenizer_config.json (the model must learn where answers end)")
    return tokenizer


def _processor_tokenizer(spec: ModelSection, data: DataSection | None):
    from transformers import AutoProcessor

    from disttrain.data.vision import VisionInputs, attach

    try:
        processor = AutoProcessor.from_pretrained(spec.tokenizer_name_or_path or spec.name_or_path,
                                                  revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, ImportError, AttributeError) as exc:  # no processor files, torchvision missing
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DisttrainError(f"model.name_or_path={spec.name_or_path} is a vision-language model but its processor "
                             f"cannot be loaded ({type(exc).__name__}: {said}); the Qwen-VL processors need "
                             "torchvision (docs/vlm.md)") from None
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(processor, "image_processor"):
        raise DisttrainError(f"model.name_or_path={spec.name_or_path}: its processor "
                             f"({type(processor).__name__}) has no tokenizer and image processor")
    if tokenizer.chat_template is None and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template  # the data path renders with the tokenizer
    limits = {} if data is None else {"max_pixels": data.max_pixels, "min_pixels": data.min_pixels,
                                      "max_images": data.max_images, "max_seq_len": data.max_seq_len}
    attach(tokenizer, VisionInputs(processor, **limits))
    return tokenizer


def _quantization_kwargs(spec: ModelSection, sharded: bool, local_device: int | None) -> dict:
    """QLoRA: NF4 base weights stored in the compute dtype, so FSDP / ZeRO-3 can flatten and shard them
    next to the LoRA weights (bnb_4bit_quant_storage); replicated strategies load onto their own GPU."""
    if spec.quantization is None:
        return {}
    from transformers import BitsAndBytesConfig

    dtype = DTYPES[spec.dtype] if spec.dtype != "auto" else torch.bfloat16
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    kwargs = {"quantization_config": config}
    if not sharded and local_device is not None:
        kwargs["device_map"] = {"": local_device}
    return kwargs


def _router_kwargs(spec: ModelSection) -> dict:
    """MoE: the router's load-balancing loss in the forward (its router logits returned, its weight set); the
    loss objects add it as transformers' own loss does (objectives/token_loss.py)."""
    if spec.router_aux_loss_coef is None:
        return {}
    from disttrain.model.family import Family

    if not Family.of_recipe(spec).moe:  # a dense model's constructor would fail on the keyword, in a traceback
        raise DisttrainError(f"model.router_aux_loss_coef: {spec.name_or_path} is not a mixture of experts (its "
                             "config names no experts per token); remove the field")
    return {"output_router_logits": True, "router_aux_loss_coef": spec.router_aux_loss_coef}


def load_model(spec: ModelSection, lora: LoraSection | None, sharded: bool = False, local_device: int | None = None,
               tp: int = 1, ep: int = 1, fsdp_data: tuple[int, int] = (1, 1), bf16: bool = False,
               head: str = "causal_lm", pad_token_id: int | None = None):
    """`sharded`: FSDP or ZeRO-3 will shard the weights; `local_device`: this rank's GPU index, if any; `tp`:
    tensor-parallel ranks, which transformers splits the weights over by the model's own plan, `ep` the
    expert-parallel ranks each MoE block's experts are split over by its expert-parallel plan, and `fsdp_data`
    the (replicas, shards) of the FSDP2 it lays over them (`bf16`: its all-gathers in bf16, reductions in fp32).
    `head`: causal_lm (the language model), or score (a reward model: the same body with transformers' one-label
    sequence-classification head, new, read at each row's last token before `pad_token_id`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    from disttrain.model.family import Family

    kwargs = {"num_labels": 1, "pad_token_id": pad_token_id} if head == "score" else {}
    vision = Family.of_recipe(spec).vision
    model_class = (AutoModelForSequenceClassification if head == "score"
                   else AutoModelForImageTextToText if vision else AutoModelForCausalLM)
    fp8.quiet_torchao_on_cpu()  # transformers imports torchao (when installed) in from_pretrained
    model = model_class.from_pretrained(
        spec.name_or_path, revision=spec.revision, dtype=DTYPES[spec.dtype],
        attn_implementation=spec.attn_implementation, trust_remote_code=spec.trust_remote_code,
        use_safetensors=True,  # never unpickle weights
        **_quantization_kwargs(spec, sharded, local_device), **_router_kwargs(spec),
        **_distributed_kwargs(tp, ep, fsdp_data, bf16), **kwargs)
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    if spec.gradient_checkpointing:
        # non-reentrant: works with LoRA's frozen inputs, FSDP2 and torch.compile
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    frozen = frozen_parts(spec) if vision else ()
    parts.freeze(model, frozen)
    if lora is not None:
        targets = parts.lora_targets(model, lora.target_modules, frozen) if vision else None
        model = apply_lora(model, lora, spec.gradient_checkpointing, "SEQ_CLS" if head == "score" else "CAUSAL_LM",
                           targets)
    return model


def frozen_parts(spec: ModelSection) -> tuple[str, ...]:
    """The parts of a vision-language model left as they are (model.freeze; by default its image encoder)."""
    return tuple(spec.freeze) if spec.freeze is not None else parts.DEFAULT_FROZEN


def _distributed_kwargs(tp: int, ep: int, fsdp_data: tuple[int, int], bf16: bool) -> dict:
    """transformers splits the weights by the model's own plans as it loads them (tensor parallelism: every weight
    matrix; expert parallelism: each MoE block's experts, with the all-to-all that brings them their tokens), and
    shards them over the data ranks with FSDP2 by its FSDP plan (the decoder layers, the embeddings, the final norm
    with lm_head; the experts over the processes holding the same ones)."""
    if tp == 1 and ep == 1:
        return {}
    from transformers.distributed import DistributedConfig

    replicas, shards = fsdp_data  # the model's config was checked against them before the launch (compat)
    split = {"tp_size": tp, "tp_plan": "auto"} if tp > 1 else {"ep_size": ep}
    return {"distributed_config": DistributedConfig(**split, fsdp_size=shards, dp_replicate_size=replicas,
                                                    fsdp_mixed_precision=bf16 and replicas * shards > 1)}


def apply_lora(model, lora: LoraSection, gradient_checkpointing: bool, task_type: str = "CAUSAL_LM",
               targets: list[str] | None = None):
    """peft's LoRA; task_type SEQ_CLS (a reward model) also trains the new score head in full. `targets`: the
    full names of the layers to adapt, instead of lora.target_modules (a vision-language model's parts not
    frozen: model/parts.py)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets if targets is not None else lora.target_modules,
                        target_parameters=lora.target_parameters,
                        modules_to_save=lora.modules_to_save,
                        use_dora=lora.use_dora, use_rslora=lora.use_rslora, init_lora_weights=lora.init_lora_weights,
                        rank_pattern=lora.rank_pattern, alpha_pattern=lora.alpha_pattern, task_type=task_type)
    if gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings would otherwise cut the graph
    model = get_peft_model(model, config)
    # the same initial adapters under every strategy and mesh; split adapters sized as their weights: lora_init.py
    if not (lora.use_dora and lora.init_lora_weights is False):  # DoRA's magnitudes were taken from peft's draws
        lora_init.seed_adapters(model, lora.init_lora_weights)
    lora_init.size_split_adapters(model)
    return model


def add_embedding_noise(model, alpha: float | None, accelerator, sequence_parts: int = 1) -> None:
    """NEFTune (training.neftune_alpha): uniform noise on the input embeddings while training, through
    transformers' own hook; evaluation and generation see clean embeddings. The hook scales the noise by
    1/sqrt(the length it sees x hidden): where each process embeds 1/`sequence_parts` of every sequence (Ulysses,
    context parallelism) alpha is divided by sqrt(sequence_parts), so the noise is the whole sequence's, as one
    process draws it (not sqrt(parts) times larger)."""
    if alpha:
        from transformers.integrations.neftune import activate_neftune

        from disttrain.runtime.backends import bare_model

        # unwrapped here, not by transformers: its unwrap keeps a compiled DDP copy that has no input embeddings
        activate_neftune(bare_model(accelerator, model) if accelerator else model, alpha / sequence_parts ** 0.5)


def is_peft_model(model) -> bool:
    if "peft" not in sys.modules:  # nothing imported peft, so no model is a PeftModel (and its import is slow)
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)

"""Model and tokenizer in, HF model dir out: loading (dtype, attention, checkpointing, LoRA) and export."""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from disttrain.config import LoraSection, ModelSection
from disttrain.errors import DisttrainError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(spec: ModelSection):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_name_or_path or spec.name_or_path,
                                              revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels = -100), so reusing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise DisttrainError(f"tokenizer of {spec.name_or_path!r} has no eos_token; set one in its "
                             "tokenizer_config.json (the model must learn where answers end)")
    return tokenizer


def _quantization_kwargs(spec: ModelSection, sharded: bool, local_device: int | None) -> dict:
    """QLoRA: NF4 base weights stored in the compute dtype, so FSDP / ZeRO-3 can flatten and shard them
    next to the LoRA weights (bnb_4bit_quant_storage); replicated strategies load onto their own GPU."""
    if spec.quantization is None:
        return {}
    from transformers import BitsAndBytesConfig

    dtype = _DTYPES[spec.dtype] if spec.dtype != "auto" else torch.bfloat16
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    kwargs = {"quantization_config": config}
    if not sharded and local_device is not None:
        kwargs["device_map"] = {"": local_device}
    return kwargs


def load_model(spec: ModelSection, lora: LoraSection | None, sharded: bool = False, local_device: int | None = None):
    """`sharded`: FSDP or ZeRO-3 will shard the weights; `local_device`: this rank's GPU index, if any."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        spec.name_or_path, revision=spec.revision, dtype=_DTYPES[spec.dtype],
        attn_implementation=spec.attn_implementation, trust_remote_code=spec.trust_remote_code,
        use_safetensors=True,  # never unpickle weights
        **_quantization_kwargs(spec, sharded, local_device))
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    if spec.gradient_checkpointing:
        # non-reentrant: works with LoRA's frozen inputs, FSDP2 and torch.compile
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        model = apply_lora(model, lora, spec.gradient_checkpointing)
    return model


def apply_lora(model, lora: LoraSection, gradient_checkpointing: bool):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, modules_to_save=lora.modules_to_save,
                        use_dora=lora.use_dora, use_rslora=lora.use_rslora, init_lora_weights=lora.init_lora_weights,
                        rank_pattern=lora.rank_pattern, alpha_pattern=lora.alpha_pattern, task_type="CAUSAL_LM")
    if gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings would otherwise cut the graph
    return get_peft_model(model, config)


def count_parameters(model) -> tuple[int, int]:
    from disttrain.flops import numel

    total = trainable = 0
    for p in model.parameters():
        n = numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def is_peft_model(model) -> bool:
    if "peft" not in sys.modules:  # nothing imported peft, so no model is a PeftModel (and its import is slow)
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def export(accelerator, model, tokenizer, out_dir: str | Path, spec: ModelSection, merge_lora: bool = False) -> Path:
    """Write a standard HF dir (safetensors + config + tokenizer) that from_pretrained loads.
    `spec` (the recipe's model section) is how the base model is reloaded for `merge_lora`.

    Every rank takes part in gathering the weights (FSDP/ZeRO-3 shards are collected to the main process
    only); only the main process writes, into a temporary dir renamed into place, so a crash never leaves
    a half-written model where a user would load it.
    """
    out = Path(out_dir)
    state_dict = accelerator.get_state_dict(model)  # collective: all ranks must call it
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if merge_lora and is_peft_model(unwrapped):
            with _without_zero3_init(accelerator):
                _save_merged(tmp, unwrapped, spec)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    accelerator.wait_for_everyone()
    return out


@contextmanager
def _without_zero3_init(accelerator):
    """While a ZeRO-3 config is registered, transformers builds every model inside DeepSpeed's zero.Init, whose
    partitioning is a collective: the merged copy, built on the main process alone, would wait there for
    ranks that never join (the export hung under ZeRO-3). Unregistered meanwhile, restored after."""
    state = getattr(accelerator, "state", None)
    registered = getattr(getattr(state, "deepspeed_plugin", None), "dschf", None)
    if registered is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def _save_merged(adapter_dir: Path, peft_model, spec: ModelSection) -> None:
    """Merge the adapter into a CPU copy of the base model and save it under adapter_dir/merged.
    The base is reloaded as the recipe loaded it (revision, remote code, dtype): another revision or dtype
    would merge the adapter into other weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = peft_model.peft_config["default"].base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path, revision=spec.revision, dtype=_DTYPES[spec.dtype],
                                                trust_remote_code=spec.trust_remote_code,
                                                use_safetensors=True)  # never unpickle
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(adapter_dir / "merged", safe_serialization=True)

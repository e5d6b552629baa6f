"""HF model dir out: the trained weights (gathered from every strategy's shards) as a standard
`from_pretrained` directory, or the LoRA adapter (optionally merged into its base as well)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from disttrain.data.vision import saved_with
from disttrain.model.loading import DTYPES, is_peft_model
from disttrain.model.stages import stage_of, write_stage_adapters, write_stage_weights
from disttrain.recipe.schema import ModelSection
from disttrain.runtime.backends import bare_model


def export_model(accelerator, model, tokenizer, out_dir: str | Path, spec: ModelSection,
                 merge_lora: bool = False) -> Path:
    """Write a standard HF dir (safetensors + config + tokenizer) that from_pretrained loads.
    `spec` (the recipe's model section) is how the base model is reloaded for `merge_lora`.

    Every rank takes part in gathering the weights (FSDP/ZeRO-3 shards are collected to the main process
    only; tensor-parallel shards by transformers inside save_pretrained); only the main process writes, into
    a temporary dir renamed into place, so a crash never leaves a half-written model where a user would load
    it.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if stage_of(bare_model(accelerator, model)) is not None:
        return _export_stages(accelerator, bare_model(accelerator, model), tokenizer, out, tmp, spec, merge_lora)
    state_dict = accelerator.get_state_dict(model)  # collective: all ranks must call it
    unwrapped = bare_model(accelerator, model)
    state_dict, masters = _zero_fp32_masters(accelerator, unwrapped, state_dict, spec)  # collective too
    gathers = bool(getattr(unwrapped, "_tp_size", None))  # tensor-parallel: save_pretrained gathers the shards
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    # tied parameters once, as one process writes them: gathered copies (FSDP2, ZeRO-3, tensor parallelism) share
    # no storage, so save_pretrained would write both names
    state_dict = _without_aliases(unwrapped, state_dict) if state_dict is not None else state_dict
    if gathers:
        accelerator.wait_for_everyone()  # the leftover is gone before anything is written
    if gathers or accelerator.is_main_process:  # every rank takes part in the gather, the main process writes
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True,
                                  is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        if masters and (tmp / "config.json").is_file():
            _record_dtype(tmp / "config.json", "float32")  # save_pretrained wrote the bf16 module's dtype
        if merge_lora and is_peft_model(unwrapped):
            with without_zero3_init(accelerator):
                _save_merged(tmp, unwrapped, spec)
            saved_with(tokenizer).save_pretrained(tmp / "merged")  # a model dir of its own: loads alone
        saved_with(tokenizer).save_pretrained(tmp)  # a vision-language model's processor: AutoProcessor loads it
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    accelerator.wait_for_everyone()
    return out


def _export_stages(accelerator, model, tokenizer, out: Path, tmp: Path, spec: ModelSection, merge_lora: bool) -> Path:
    """A pipeline's stages (parallel/pipeline.py) as one sharded HF checkpoint: each stage's file written by the
    first of its processes, the index, config and tokenizer by the main process; LoRA: the adapters of every stage
    gathered to the main process, written (and merged) as above. Renamed into place as above."""
    import json

    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if is_peft_model(model):
        write_stage_adapters(model, tmp, accelerator.is_main_process)  # collective
        if accelerator.is_main_process:
            if merge_lora:
                _save_merged(tmp, model, spec)
                saved_with(tokenizer).save_pretrained(tmp / "merged")
    else:
        weight_map = write_stage_weights(model, tmp)  # collective
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and not is_peft_model(model):
        sizes = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": sizes}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        model.config.save_pretrained(tmp)  # the whole model's (each stage's inner model holds a cut copy)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
    if accelerator.is_main_process:
        saved_with(tokenizer).save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    accelerator.wait_for_everyone()
    return out


def _zero_fp32_masters(accelerator, unwrapped, state_dict: dict, spec: ModelSection) -> tuple[dict, bool]:
    """(the state dict to write, whether it holds ZeRO's fp32 masters). Under DeepSpeed with bf16/fp16 the
    module trains in the low precision and the optimizer keeps fp32 masters of the trained weights; for a recipe
    whose model.dtype is float32 the export takes those masters (DeepSpeed's own safe_get_full_fp32_param, a
    collective under ZeRO: every rank calls it, in the same order), as the checkpoint readers (zero_to_fp32,
    `make eval` / `make export` of a checkpoint) do: the run and its last checkpoint are one model."""
    if getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is None:
        return state_dict, False
    loaded = str(getattr(unwrapped.config, "dtype", "")).replace("torch.", "")  # as loaded (model.dtype: auto)
    if spec.dtype != "float32" and not (spec.dtype == "auto" and loaded == "float32"):
        return state_dict, False
    if all(p.dtype == torch.float32 for p in unwrapped.parameters()):
        return state_dict, False  # trained in fp32: the module's weights are the masters
    from deepspeed.utils import safe_get_full_fp32_param

    names: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}
    for name, param in unwrapped.named_parameters(remove_duplicate=False):  # tied weights: one master, two names
        names.setdefault(id(param), (param, []))[1].append(name)
    out = dict(state_dict) if state_dict is not None else None  # ZeRO-3 gathers to the main process only
    for param, aliases in names.values():
        if not param.requires_grad:
            continue  # frozen (a LoRA base): no master; a LoRA export writes the adapter alone
        full = safe_get_full_fp32_param(param)
        if full is not None and out is not None and accelerator.is_main_process:
            for name in aliases:
                if name in out:
                    out[name] = full.detach().to("cpu", torch.float32).reshape(out[name].shape).clone()
    return out, True


def _record_dtype(config_file: Path, dtype: str) -> None:
    import json

    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _without_aliases(model, state_dict: dict) -> dict:
    """Tied parameters (one Parameter under two names: the embeddings and lm_head) once, under the first name, as
    transformers writes them: it finds ties by shared storage, which gathered copies lose (both names would be
    written)."""
    first: dict[int, str] = {}
    aliases = {name for name, param in model.named_parameters(remove_duplicate=False)
               if first.setdefault(id(param), name) != name}
    return {name: value for name, value in state_dict.items() if name not in aliases}


@contextmanager
def without_zero3_init(accelerator):
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
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    config = peft_model.peft_config["default"]
    base_path = config.base_model_name_or_path
    score = str(config.task_type) in ("SEQ_CLS", "TaskType.SEQ_CLS")  # a reward model: its one-label score head
    vision = getattr(peft_model.config, "vision_config", None) is not None
    model_class = (AutoModelForSequenceClassification if score else AutoModelForImageTextToText if vision
                   else AutoModelForCausalLM)
    head = {"num_labels": 1, "pad_token_id": peft_model.config.pad_token_id} if score else {}
    base = model_class.from_pretrained(base_path, revision=spec.revision, dtype=DTYPES[spec.dtype],
                                       trust_remote_code=spec.trust_remote_code,
                                       use_safetensors=True, **head)  # never unpickle
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(adapter_dir / "merged", safe_serialization=True)

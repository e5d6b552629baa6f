"""A training checkpoint (checkpoints/step-N/, any strategy) back to a model in one process, without the
launch that wrote it: the run's recipe (recipe.yaml beside checkpoints/) rebuilds the model, and the
checkpoint's weights are read in the layout its strategy wrote them:

    model.safetensors              DDP, one process: accelerate's save_state of the unwrapped model
    pytorch_model_fsdp_0/          FSDP2 (and HSDP): DCP shards, read with torch.distributed.checkpoint
    tp_state/                      tensor parallelism: DCP shards of weights and optimizer, read the same way
    latest + pytorch_model/        DeepSpeed ZeRO-1/2/3 (and Ulysses): the fp32 master weights, gathered by
                                   DeepSpeed's own zero_to_fp32 (it unpickles the shards: your own files only)

A LoRA run takes only the adapter (and modules_to_save) from the checkpoint, the frozen base from the recipe's
model, as training did (QLoRA's 4-bit base is reloaded unquantized, as its merged export is). Used by
`make eval RUN=<checkpoint>` (disttrain/evaluation) and by the evaluation during training."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from disttrain.errors import DisttrainError

TRAINER_STATE = "trainer_state.json"  # training/checkpoint.py writes it into every complete checkpoint


def is_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file()


def run_recipe(checkpoint: Path):
    """The recipe the run was trained with: <run>/recipe.yaml, two levels above <run>/checkpoints/step-N."""
    import yaml

    from disttrain.recipe.schema import Recipe

    saved = checkpoint.parent.parent / "recipe.yaml"
    if not saved.is_file():
        raise DisttrainError(f"{checkpoint}: no recipe.yaml in the run dir above it ({saved}); the model cannot be "
                             "rebuilt around the checkpoint's weights (a checkpoint is read inside its run dir)")
    return Recipe.model_validate(yaml.safe_load(saved.read_text()))


def load(checkpoint: str | Path, device: str | torch.device = "cpu"):
    """(model, tokenizer, recipe): the run's model with the checkpoint's weights, in the recipe's dtype."""
    from disttrain.model.loading import load_model, load_tokenizer

    checkpoint = Path(checkpoint)
    recipe = run_recipe(checkpoint)
    spec = recipe.model.model_copy(update={"quantization": None, "gradient_checkpointing": False})
    model = load_model(spec, recipe.lora)
    wanted = _weights_to_read(model, recipe.lora is not None)
    found = read_weights(checkpoint, wanted, _aliases(model))
    missing = set(wanted) - set(found)
    if missing:
        raise DisttrainError(f"{checkpoint} lacks {len(missing)} of the model's weights (e.g. {sorted(missing)[0]}): "
                             "it was not written for this run's recipe.yaml")
    with torch.no_grad():
        for name, tensor in found.items():
            wanted[name].copy_(tensor)
    model.config.use_cache = True  # evaluation generates
    return model.to(device).eval(), load_tokenizer(spec), recipe


def _weights_to_read(model, lora: bool) -> dict[str, torch.Tensor]:
    """name -> the model's own tensor to fill: every weight (tied ones once), or a LoRA run's trained ones."""
    params = dict(model.named_parameters())  # tied weights appear once
    if lora:
        return {name: p.data for name, p in params.items() if p.requires_grad}
    buffers = {name: b for name, b in model.named_buffers() if name in model.state_dict()}  # persistent only
    return {**{name: p.data for name, p in params.items()}, **buffers}


def _aliases(model) -> dict[str, list[str]]:
    """name -> every name its tensor has (tied embeddings: embed_tokens and lm_head): a writer may keep any one."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group for group in names.values()}


def _pick(state: dict, wanted: dict, aliases: dict) -> dict[str, torch.Tensor]:
    picked = {}
    for name in wanted:
        present = [alias for alias in aliases.get(name, [name]) if alias in state]
        if present:
            picked[name] = state[present[0]]
    return picked


def read_weights(checkpoint: Path, wanted: dict[str, torch.Tensor], aliases: dict[str, list[str]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for the names in `wanted` (shaped like them), whatever strategy wrote it."""
    aliases = aliases or {}
    for dcp_dir in ("pytorch_model_fsdp_0", "tp_state"):  # FSDP2's (accelerate's), tensor parallelism's
        if (checkpoint / dcp_dir).is_dir():                 # (training/accelerator_state.py)
            import torch.distributed.checkpoint as dcp

            # both hold {"model": state_dict}; DCP loads in place, resharding to these plain tensors. no_dist: one
            # process reads (scoring during training reads on the main process while the others poll the store;
            # DCP would otherwise plan collectively on the default group and hang)
            target = {name: torch.empty_like(t, device="cpu") for name, t in wanted.items()}
            dcp.load({"model": target}, checkpoint_id=str(checkpoint / dcp_dir), no_dist=True)
            return target
    if (checkpoint / "latest").is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag = (checkpoint / "latest").read_text().strip()
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
        return _pick(state, wanted, aliases)
    if (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return _pick(load_file(checkpoint / "model.safetensors"), wanted, aliases)
    raise DisttrainError(f"{checkpoint}: no model weights in a layout this project writes (model.safetensors, "
                         "pytorch_model_fsdp_0/, tp_state/, DeepSpeed's latest + tag dir)")


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """The checkpoint as a standard HF dir (a whole model, or a LoRA run's adapter with its base named),
    with the run's tokenizer; written to a temporary dir and renamed into place."""
    model, tokenizer, _ = load(checkpoint)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "from_checkpoint.json").write_text(json.dumps({"checkpoint": str(checkpoint)}))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv=None) -> Path:
    import argparse

    parser = argparse.ArgumentParser(description="A training checkpoint (any strategy) as a standard HF model dir.")
    parser.add_argument("checkpoint", help="<run>/checkpoints/step-N")
    parser.add_argument("out", nargs="?", help="default: <run>/exported/step-N")
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    if not (checkpoint.is_dir() and is_checkpoint(checkpoint)):
        raise DisttrainError(f"{checkpoint} is not a complete checkpoint (no {TRAINER_STATE}); give "
                             "<run>/checkpoints/step-N (an unfinished .tmp-step-N is never complete)")
    out = export(checkpoint, args.out or checkpoint.parent.parent / "exported" / checkpoint.name)
    print(f"exported {checkpoint} -> {out}")
    return out


if __name__ == "__main__":
    import sys

    from disttrain.errors import exit_on_user_error

    with exit_on_user_error():
        main(sys.argv[1:])

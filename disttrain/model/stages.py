"""A decoder LM cut into pipeline stages (parallel/pipeline.py runs them): a stage is the HF model itself with what
it does not hold removed -- the embeddings on the first stage, the final norm and lm_head on the last -- and its
own run of decoder layers, kept under their original names (`model.layers.<i>`: a ModuleList whose keys are the
original indices), so that checkpoints (DCP) and the export carry the whole model's names without renaming. Its
forward is the family's own inner model forward (masks, rotary embeddings) over that run of layers, from the token
ids on the first stage and from the received hidden states on the others; the last stage returns the micro-batch's
summed token loss.

Why by hand, not torch's tracer: `pipeline()` traces the whole HF forward into a graph (masks, rotary tables, the
output dataclass), which transformers' models do not trace cleanly; torchtitan cuts its models by module names too.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn


class StagePlace(NamedTuple):
    """Where this process sits: its stage of how many, its data rank of how many, the decoder layers it holds."""

    stage: int
    stages: int
    data_rank: int
    data_ranks: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def stage_layers(num_layers: int, stage: int, stages: int) -> tuple[int, ...]:
    """The decoder layers of `stage`: equal consecutive runs (the check refuses layers that do not divide)."""
    per = num_layers // stages
    return tuple(range(stage * per, (stage + 1) * per))


def cut_to_stage(model, place: StagePlace, head_loss):
    """The causal LM `model` cut in place to the stage `place` names (the module docstring says how); returns it,
    its forward now the stage's: (token ids | hidden states[, labels]) -> hidden states | on the last stage
    head_loss(final hidden states, lm_head, labels), the micro-batch's summed token loss (without labels: what
    lm_head returns, the loss engine's per-token losses in evaluation)."""
    inner = model.model
    kept = nn.ModuleList()
    kept._modules = OrderedDict((str(i), inner.layers[i]) for i in place.layers)  # original names: model.layers.<i>
    inner.layers = kept
    config = copy.copy(inner.config)  # the inner forward loops over its own layers with their types
    config.num_hidden_layers = len(place.layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in place.layers]
    inner.config = config
    if not place.first:
        inner.embed_tokens = None
    if not place.last:
        inner.norm = nn.Identity()
        model.lm_head = None

    def forward(received: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if place.first:
            hidden = inner(input_ids=received, use_cache=False).last_hidden_state
        else:
            hidden = inner(inputs_embeds=received, use_cache=False).last_hidden_state
        if not place.last:
            return hidden
        if labels is None:  # evaluation: what lm_head returns (the loss engine's per-token losses)
            return model.lm_head(hidden)
        return head_loss(hidden, model.lm_head, labels)  # inside forward: FSDP2 has lm_head whole

    model.forward = forward
    model._disttrain_stage = place
    return model


def stage_of(model) -> StagePlace | None:
    """The stage a model was cut to (None: a whole model)."""
    return getattr(model, "_disttrain_stage", None)


def write_stage_adapters(model, directory, is_main: bool) -> None:
    """Collective over every process: a LoRA model's adapters, each stage's selected by peft from its weights
    gathered whole (FSDP2), written by the main process as one adapter (peft's config and file, every stage's
    tensors in the file)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {name: value.detach().cpu().contiguous() for name, value in
            get_peft_model_state_dict(model, state_dict=weights).items()} if stage_of(model).data_rank == 0 else {}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.gather_object(mine, every if is_main else None, dst=0)
    if is_main:
        model.save_pretrained(directory, state_dict=weights, safe_serialization=True)  # its config, this stage
        save_file({name: value for part in every for name, value in part.items()},
                  str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def write_stage_weights(model, directory) -> dict[str, str]:
    """Collective over every process: each stage's weights gathered whole over its data-parallel
    processes (FSDP2), the first of them writing them as one safetensors file of a sharded HF checkpoint
    (model-0000s-of-0000S.safetensors); returns the index's weight map {name: file} on every process."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    place = stage_of(model)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    name = f"model-{place.stage + 1:05d}-of-{place.stages:05d}.safetensors"
    if place.data_rank == 0:
        save_file({key: value.detach().cpu().contiguous() for key, value in weights.items()},
                  str(directory / name), metadata={"format": "pt"})
    names: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, (name, sorted(weights)) if place.data_rank == 0 else None)
    return {key: entry[0] for entry in names if entry is not None for key in entry[1]}

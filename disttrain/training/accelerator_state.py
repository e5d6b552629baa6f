"""accelerator.save_state / load_state, with the weights and optimizer states of a model transformers laid out
(tensor parallelism, alone or under FSDP2; expert parallelism) written through DCP.

Why: under tensor parallelism alone accelerate leaves the model unwrapped and saves it like a DDP model: one
safetensors file from the main process, which cannot hold DTensors ("Attempted to access the data pointer on an
invalid python storage"), and one optimizer file, also from the main process only, while every rank holds other
shards. So every rank writes its shards of both with torch.distributed.checkpoint (`tp_state/` in the
checkpoint), and accelerate saves the rest (schedule, RNG, data position) with the model and optimizer out of its
lists for that call. A pipeline's stages (parallel/pipeline.py) are saved the same way: each stage keeps the
whole model's names, so the stages' DCP shards together are the whole model; its optimizer state is flattened to
one entry per parameter name (each stage's param_groups list other names, which DCP would otherwise merge as one
value). Other strategies: accelerate's own save_state and load_state, unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

TP_STATE = "tp_state"


def _laid_out(accelerator):
    """(model, torch optimizer, state dict options) when transformers laid the model out (tensor or expert
    parallelism) or it is a pipeline's stage (accelerate left both as they are), else None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from disttrain.runtime.backends import laid_out_by_transformers, pipeline_size

    if not laid_out_by_transformers() and pipeline_size() == 1:
        return None
    (model,), (optimizer,) = accelerator._models, accelerator._optimizers
    options = StateDictOptions(flatten_optimizer_state_dict=pipeline_size() > 1)
    return model, getattr(optimizer, "optimizer", optimizer), options


@contextmanager
def _without_model_and_optimizer(accelerator):
    """accelerate saves and loads what it prepared (its private lists); the model and optimizer are left out of
    them for one call."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def save_state(accelerator, directory: Path) -> None:
    """Collective: every rank writes its shards."""
    parts = _laid_out(accelerator)
    if parts is None:
        accelerator.save_state(str(directory))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, options = parts
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / TP_STATE))
    with _without_model_and_optimizer(accelerator):
        accelerator.save_state(str(directory))


def load_state(accelerator, directory: Path) -> None:
    """Collective: every rank reads its shards (the same mesh as the save: checkpoint.check_shape)."""
    parts = _laid_out(accelerator)
    if parts is None:
        accelerator.load_state(str(directory))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, options = parts
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / TP_STATE))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    with _without_model_and_optimizer(accelerator):
        accelerator.load_state(str(directory))

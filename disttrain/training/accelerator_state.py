"""accelerator.save_state / load_state, with the weights and optimizer states of a model transformers laid out
(tensor parallelism, alone or under FSDP2; expert parallelism) written through DCP.

Why: under tensor parallelism alone accelerate leaves the model unwrapped and saves it like a DDP model: one
safetensors file from the main process, which cannot hold DTensors ("Attempted to access the data pointer on an
invalid python storage"), and one optimizer file, also from the main process only, while every rank holds other
shards. So every rank writes its shards of both with torch.distributed.checkpoint (`tp_state/` in the
checkpoint), and accelerate saves the rest (schedule, RNG, data position) with the model and optimizer out of its
lists for that call. Other strategies: accelerate's own save_state and load_state, unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

TP_STATE = "tp_state"


def _laid_out(accelerator):
    """(model, torch optimizer) when transformers laid the model out (tensor or expert parallelism: accelerate
    left it as it is), else None."""
    from disttrain.runtime.backends import laid_out_by_transformers

    if not laid_out_by_transformers():
        return None
    (model,), (optimizer,) = accelerator._models, accelerator._optimizers
    return model, getattr(optimizer, "optimizer", optimizer)


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

    model_state, optimizer_state = get_state_dict(*parts)
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

    model_state, optimizer_state = get_state_dict(*parts)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / TP_STATE))
    set_state_dict(*parts, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    with _without_model_and_optimizer(accelerator):
        accelerator.load_state(str(directory))

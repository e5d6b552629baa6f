"""What `make eval RUN=...` evaluates: a run dir (its exported model, final/), a checkpoint of a run (exported to a
model dir first: model/from_checkpoint.py), a model dir or a LoRA adapter dir.

An adapter is evaluated on its base (lm-eval's `hf` model with `peft=`), the way peft loads it; the base model
of a run is the one its adapter names, or, for a whole model, the recipe's model.name_or_path (recipe.yaml)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from disttrain.errors import DisttrainError
from disttrain.model import from_checkpoint

FINAL = "final"  # what train.py exports at the end of a run (training/handover.py)


@dataclass(frozen=True)
class Model:
    pretrained: str  # a model dir or Hub name: lm-eval's `pretrained`
    adapter: str | None = None  # a LoRA adapter dir on top of it: lm-eval's `peft`
    source: str | None = None  # what it was exported from (a checkpoint), shown instead of the temporary dir

    @property
    def label(self) -> str:
        if self.source:
            return self.source
        return f"{self.pretrained} + adapter {self.adapter}" if self.adapter else self.pretrained


@dataclass(frozen=True)
class Target:
    model: Model
    base: Model | None  # what it was fine-tuned from, when known
    out_dir: Path  # where eval/results.json goes: the run dir, or the model dir itself
    key: str = "fine_tuned"  # its column in results.json: a checkpoint's is its name (step-00000120)


@contextmanager
def opened(path: str) -> Iterator[Target]:
    """resolve(path); a checkpoint is exported (<run>/eval/<step>.model/) for as long as it is evaluated."""
    where = Path(path)
    if not (where.is_dir() and from_checkpoint.is_checkpoint(where)):
        yield resolve(path)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DisttrainError(f"make eval: {where} is a checkpoint: export it once (make export CHECKPOINT=...) "
                             "and launch the data-parallel evaluation on the exported dir")
    run_dir = where.parent.parent
    exported = run_dir / "eval" / f"{where.name}.model"
    try:
        from_checkpoint.export(where, exported)
        target = resolve(str(exported))
        model = Model(target.model.pretrained, target.model.adapter, source=str(where))
        yield Target(model, _recipe_base(run_dir) if target.base is None else target.base, run_dir, where.name)
    finally:
        shutil.rmtree(exported, ignore_errors=True)


def resolve(path: str) -> Target:
    """A run dir, a model dir or an adapter dir -> what to evaluate; one line when it is none of them."""
    where = Path(path)
    if not where.is_dir():
        raise DisttrainError(f"make eval: RUN={path} is not a directory; give a run's output dir (with final/), "
                             "a checkpoint (checkpoints/step-N), a model dir (config.json) or a LoRA adapter dir "
                             "(adapter_config.json)")
    model_dir, out_dir = where, where
    if (where / FINAL).is_dir():
        model_dir = where / FINAL
    elif (where / "metrics.jsonl").is_file():  # a run that has not exported yet
        raise DisttrainError(f"make eval: {where} has no exported model ({FINAL}/): the run has not finished; "
                             f"resume it to the end (make resume), or evaluate one of its checkpoints "
                             f"(RUN={where / 'checkpoints' / '<step-N>'})")
    if (model_dir / "adapter_config.json").is_file():
        base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        return Target(Model(base, str(model_dir)), Model(base), out_dir)
    if (model_dir / "config.json").is_file():
        return Target(Model(str(model_dir)), _recipe_base(where), out_dir)
    raise DisttrainError(f"make eval: {model_dir} holds no model (no config.json or adapter_config.json); give a "
                         "run's output dir, a model dir or a LoRA adapter dir")


def _recipe_base(run_dir: Path) -> Model | None:
    recipe = run_dir / "recipe.yaml"
    if not recipe.is_file():
        return None
    import yaml

    name = (yaml.safe_load(recipe.read_text()) or {}).get("model", {}).get("name_or_path")
    return Model(name) if name else None

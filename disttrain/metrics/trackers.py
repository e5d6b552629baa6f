"""What the trackers accelerate manages (wandb, tensorboard, mlflow) are given: the recipe as flat
scalars and the run's name."""

from __future__ import annotations

from pathlib import Path

from disttrain.recipe.schema import Recipe, flat_fields, recipe_to_dict


def start_trackers(accelerator, recipe: Recipe) -> None:
    accelerator.init_trackers(recipe.logging.project, config=tracker_config(recipe),
                              init_kwargs=tracker_init_kwargs(recipe))


def tracker_config(recipe: Recipe) -> dict:
    """The recipe as flat scalars (tensorboard hparams accept nothing else)."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in flat_fields(recipe_to_dict(recipe)).items()}


def tracker_init_kwargs(recipe: Recipe) -> dict:
    name = recipe.logging.run_name or "-".join(Path(recipe.output.dir).parts[-2:])  # e.g. tiny-sft-ddp-2
    return {"wandb": {"name": name}, "mlflow": {"run_name": name}}

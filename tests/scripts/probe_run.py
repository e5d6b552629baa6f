"""What the probe scripts launched by tests share: train.py's recipe -> accelerator -> tokenizer -> data path,
and writing one JSON per rank before leaving without interpreter teardown."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disttrain import data  # noqa: E402
from disttrain.model import loading as modeling
from disttrain.runtime.backends import build_accelerator  # noqa: E402
from disttrain.recipe.schema import load_recipe  # noqa: E402


def start():
    """(recipe, accelerator, tokenizer, train rows) from `--recipe R [key=value ...]`, as train.py builds them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    accelerator = build_accelerator(recipe)
    tokenizer = modeling.load_tokenizer(recipe.model)
    train_set, _, _ = data.build_datasets(recipe.data, tokenizer, recipe.training.seed,
                                          accelerator.main_process_first)
    return recipe, accelerator, tokenizer, train_set


def finish(recipe, accelerator, report: dict) -> None:
    """<output.dir>/rank<i>.json, then leave together, skipping interpreter teardown (see train.py: a
    finished gloo rank can abort there)."""
    out = Path(recipe.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(
        {"world": accelerator.num_processes, **report}))
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)

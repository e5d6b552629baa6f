"""Launched by tests under `accelerate launch`: records which rows each rank receives, per epoch, through
the same recipe -> accelerator -> data -> loader path that train.py uses."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disttrain import data, modeling  # noqa: E402
from disttrain.backends import build_accelerator  # noqa: E402
from disttrain.config import load_recipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--recipe", required=True)
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()
recipe = load_recipe(args.recipe, args.overrides)
accelerator = build_accelerator(recipe)
tokenizer = modeling.load_tokenizer(recipe.model)
train_set, _, _ = data.build_datasets(recipe.data, tokenizer, recipe.training.seed, accelerator.main_process_first)
loader = accelerator.prepare(data.make_loader(train_set, recipe.training.micro_batch_size,
                                              data.Collator(tokenizer.pad_token_id), True, True))
seen = {}
for epoch in range(2):
    loader.set_epoch(epoch)
    seen[epoch] = [tuple(row[:n].tolist()) for batch in loader
                   for row, n in zip(batch["input_ids"], batch["num_tokens"])]
out = Path(recipe.output.dir)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(
    {"world": accelerator.num_processes, "dataset": [list(r) for r in train_set["input_ids"]], "type": str(accelerator.distributed_type),
     "epochs": {e: [list(r) for r in rows] for e, rows in seen.items()}}))
accelerator.wait_for_everyone()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (see train.py: a finished gloo rank can abort there)

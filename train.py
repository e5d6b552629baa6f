#!/usr/bin/env python
"""Fine-tune a causal LM from a recipe, under whatever strategy `accelerate launch` was given.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --recipe recipes/tiny/sft.yaml
    accelerate launch ... train.py --recipe recipes/qwen2.5-7b/lora_sft.yaml training.lr=1e-4 output.dir=out

The recipe says what to train; the accelerate config says how to distribute it. This file is the story of
one run; each step is one call into disttrain/.
"""

from __future__ import annotations

import argparse
import sys

from disttrain.errors import DataError, exit_on_user_error


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="YAML recipe, e.g. recipes/tiny/sft.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="override any recipe field, e.g. training.max_steps=20")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    # 1. The recipe, validated before any process group or model exists.
    from disttrain.config import load_recipe

    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)

    from accelerate.utils import set_seed

    from disttrain import compat, data, loop, modeling, optim, outputs
    from disttrain.backends import build_accelerator, has_gpu, launcher_strategy, shards_weights
    from disttrain.metrics import MetricsLogger

    # 2. The distributed world, as the accelerate config describes it (impossible combinations stop here).
    compat.check(recipe, launcher_strategy(), has_gpu())
    accelerator = build_accelerator(recipe)
    set_seed(recipe.training.seed)  # identical model init (and LoRA init) on every rank
    outputs.start(accelerator, recipe)

    # 3. Tokenizer and data: tokenised once on the main process, read from the cache by the others.
    tokenizer = modeling.load_tokenizer(recipe.model)
    train_set, eval_set, reports = data.build_datasets(recipe.data, tokenizer, recipe.training.seed,
                                                       accelerator.main_process_first)
    outputs.report_data(accelerator, reports)

    # 4. How long: optimizer steps from data size, batch, accumulation and world size.
    cfg = recipe.training
    per_epoch = loop.steps_per_epoch(len(train_set), cfg.micro_batch_size, accelerator.num_processes, cfg.grad_accum)
    if per_epoch == 0:
        raise DataError(f"{recipe.data.path}: {len(train_set)} training rows cannot fill one optimizer step of "
                        f"micro_batch_size x grad_accum x processes = "
                        f"{cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes} rows")
    total_steps = cfg.max_steps or per_epoch * cfg.epochs

    # 5. Model, optimizer, schedule, loaders -> prepared for the chosen strategy.
    model = modeling.load_model(recipe.model, recipe.lora, sharded=shards_weights(accelerator),
                                local_device=accelerator.local_process_index if has_gpu() else None)
    optimizer = optim.build_optimizer(model, cfg)
    scheduler = optim.build_scheduler(optimizer, cfg, total_steps)
    collator = data.Collator(tokenizer.pad_token_id)
    train_loader = data.make_loader(train_set, cfg.micro_batch_size, collator, recipe.data.shuffle, drop_last=True)
    eval_loader = data.make_loader(eval_set, cfg.micro_batch_size, collator, False, False) if eval_set else None
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    set_seed(cfg.seed + accelerator.process_index)  # dropout differs per rank, like the data does
    outputs.describe_run(accelerator, recipe, model, launcher_strategy(), per_epoch, total_steps)

    # 6. Train.
    accelerator.init_trackers(recipe.logging.project, config=outputs.tracker_config(recipe),
                              init_kwargs=outputs.tracker_init_kwargs(recipe))
    log = MetricsLogger(accelerator, recipe.output.dir, total_steps)
    state = loop.train(accelerator, model, optimizer, scheduler, train_loader, eval_loader, cfg, log.log,
                       loop.TrainState(), total_steps, recipe.logging.every_steps, progress=log.advance)
    log.close()

    # 7. Export a standard HF model dir (full weights, or the LoRA adapter).
    if recipe.output.save_final_model:
        final = modeling.export(accelerator, model, tokenizer, outputs.final_model_dir(recipe),
                                merge_lora=bool(recipe.lora and recipe.lora.merge_on_export))
        accelerator.print(f"final model: {final}  (metrics: {log.path})")
    accelerator.end_training()
    return state


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

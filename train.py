#!/usr/bin/env python
"""Fine-tune a causal LM from a recipe, under whatever strategy `accelerate launch` was given.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --recipe recipes/tiny/sft.yaml
    accelerate launch ... train.py --recipe recipes/qwen2.5-7b/lora_sft.yaml training.lr=1e-4 output.dir=out

The recipe says what to train; the accelerate config how to distribute it. This file is the story of one run,
each step one call into disttrain/; three seams keep it free of branches: the parallel plan, the data feed and
the objective. The same command again resumes from the newest complete checkpoint."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from disttrain.runtime import startup
startup.pause_collector()  # until the run is set up: disttrain/runtime/startup.py says why
from disttrain.errors import exit_on_user_error  # noqa: E402
from disttrain.runtime import guards  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="YAML recipe, e.g. recipes/tiny/sft.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="override any recipe field, e.g. training.max_steps=20")
    return parser.parse_args(argv)


def main(argv=None):
    # 1. The recipe, validated before any process group or model exists.
    from disttrain.recipe.schema import load_recipe

    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    guards.watch(recipe.distributed.timeout_s)  # a stuck rank says where it is stuck, before the timeout

    from accelerate.utils import set_seed

    from disttrain import data
    from disttrain.data.feed import feed_for
    from disttrain.evaluation.during_training import scorer_for  # the recipe's evaluation: (lm-eval on checkpoints)
    from disttrain.metrics.log import MetricsLogger
    from disttrain.metrics.throughput import meter_for
    from disttrain.metrics.trackers import start_trackers
    from disttrain.model import loading
    from disttrain.objectives import objective_for
    from disttrain.parallel import checks
    from disttrain.parallel.plan import ParallelPlan
    from disttrain.report import run_files
    from disttrain.runtime.backends import build_accelerator, deepspeed_model_settings, has_gpu, shards_weights
    from disttrain.training import checkpoint, handover, hooks, loop, optim
    from disttrain.training.samples import build_sampler

    # 2. The distributed world as the accelerate config describes it; output.dir's {strategy}/{processes} set.
    plan = ParallelPlan.from_launch()
    recipe = recipe.for_launch(plan.label, plan.processes)
    checks.check_before_launch(recipe, plan, has_gpu())
    guards.at("creating the process group (rendezvous with the other ranks)")
    accelerator = build_accelerator(recipe)
    scorer = scorer_for(accelerator, recipe)  # an unknown evaluation task stops the run here
    startup.freeze_imports()  # what exists now lives as long as the process: out of the collector's sight
    cfg = recipe.training
    shape = checkpoint.RunShape.of(plan, cfg, recipe.data.streaming)
    resume_from, saved_state = checkpoint.resume_point(recipe.output, shape)  # a bad checkpoint fails now
    set_seed(cfg.seed)  # identical model init (and LoRA init) on every rank
    run_files.start(accelerator, recipe, resuming=resume_from is not None)

    # 3. Tokenizer and data: tokenised once on the main process, read from the cache by the others.
    guards.at("tokenising on the main process first (the other ranks wait for it)")
    tokenizer = loading.load_tokenizer(recipe.model, recipe.data)  # a vision-language model's: with its processor
    train_set, eval_sets, reports = data.build_datasets(recipe.data, tokenizer, cfg.seed,
                                                        accelerator.main_process_first)
    run_files.report_data(accelerator, reports, recipe.output.dir)

    # 4. How long: the feed counts optimizer steps from its rows, the batch and the data ranks; the objective's
    #    step source makes each step's batches from them (the feed's own, or online RL's rollouts).
    feed = feed_for(recipe, train_set, tokenizer, plan, accelerator)
    objective = objective_for(recipe)
    steps = objective.steps(feed)

    # 5. Model, objective (collator + loss), optimizer, schedule, loaders -> prepared for the strategy.
    guards.at("loading the model")
    model = loading.load_model(recipe.model, recipe.lora, sharded=shards_weights(accelerator),
                               local_device=accelerator.local_process_index if has_gpu() else None,
                               bf16=cfg.mixed_precision == "bf16", **plan.load_kwargs(),
                               **objective.model_kwargs(tokenizer))
    deepspeed_model_settings(accelerator, model)  # ZeRO-3: MoE blocks whole, buckets from the text's hidden size
    loss = objective.loss(model)
    optimizer = optim.build_optimizer(model, cfg)
    scheduler = optim.build_scheduler(optimizer, cfg, steps.total_steps)
    collator = objective.collator(tokenizer)
    eval_loaders = {name: data.make_loader(rows, cfg.micro_batch_size, collator, False, False)
                    for name, rows in eval_sets.items()}
    guards.check_initial_replicas(accelerator, model)  # same seed -> same initial weights on every rank
    guards.at("accelerator.prepare (wrapping, sharding, broadcasting the weights)")
    model, optimizer, scheduler = feed.prepare(accelerator, collator, plan.prepare_model(accelerator, model, optimizer),
                                               optimizer, scheduler)
    guards.hold_until_exit(accelerator, model, optimizer)  # freed at os._exit, not before: guards says why
    eval_loaders = {name: plan.eval_loader(accelerator, loader) for name, loader in eval_loaders.items()}
    loading.add_embedding_noise(model, cfg.neftune_alpha, accelerator, plan.sequence_parts)  # NEFTune
    set_seed(cfg.seed + plan.random_stream(accelerator))  # dropout differs per data rank (a TP group: the same)
    run_files.describe_run(accelerator, recipe, model, plan, steps.per_epoch, steps.total_steps)
    throughput = meter_for(accelerator, recipe, model)  # FLOPs per token and the device's peak: MFU

    # 6. What the objective needs before any update (DPO: its reference).
    objective.prepare(accelerator, model, loss, train_set, eval_sets, eval_loaders, collator)

    # 7. Resume: weights, optimizer, schedule, RNG and data position exactly as they were saved.
    state = loop.TrainState()
    if resume_from is not None:
        guards.at("loading the checkpoint")
        checkpoint.restore(accelerator, resume_from, saved_state, state, steps)
        accelerator.print(f"resumed from {resume_from} at step {state.step}/{steps.total_steps}")
        if handover.already_complete(accelerator, recipe, state, steps.total_steps):
            accelerator.end_training()
            return state

    # 8. Train; SIGTERM (preemption, scancel) finishes the step, checkpoints and exits.
    signal.signal(signal.SIGTERM, loop.request_stop)
    start_trackers(accelerator, recipe)
    startup.resume_collector()
    log = MetricsLogger(accelerator, recipe.output.dir, steps.total_steps, initial_step=state.step)
    checkpointer = checkpoint.Checkpointer.for_output(accelerator, recipe.output, shape, steps.rank_state,
                                                      checkpoint.expected_bytes(model))
    sampler = build_sampler(accelerator, model, tokenizer, recipe, eval_sets, train_set, log.log)
    run = loop.Run(accelerator, loop.Trainable(model, optimizer, scheduler), loss, steps, recipe, plan, checkpointer,
                   throughput)
    state = loop.train(run, state, hooks.for_run(run, hooks.Periodic(log.advance, eval_loaders, sampler, scorer)),
                       log.log)
    log.close()
    if state.step < steps.total_steps:
        accelerator.print(f"stopped at step {state.step}/{steps.total_steps}; checkpoint {checkpointer.last_saved}. "
                          "Run the same command again to resume.")
        accelerator.end_training()
        return state

    # 9. Hand over: one sample, the exported model (HF dir or adapter), card and plots, the Hub upload.
    handover.hand_over(accelerator, recipe, model, tokenizer, sampler, state, log.path)
    return state


if __name__ == "__main__":
    with exit_on_user_error(), guards.collective_failures_explained():
        main(sys.argv[1:])
    # Everything is written, the process group and trackers are closed. Skip interpreter teardown: there a C++ thread
    # of the distributed stack sometimes aborts a finished rank (SIGABRT), which fails the launch after a good run.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)

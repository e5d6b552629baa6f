#!/usr/bin/env python
"""Fine-tune a causal LM from a recipe, under whatever strategy `accelerate launch` was given.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --recipe recipes/tiny/sft.yaml
    accelerate launch ... train.py --recipe recipes/qwen2.5-7b/lora_sft.yaml training.lr=1e-4 output.dir=out

The recipe says what to train; the accelerate config says how to distribute it. This file is the story of
one run; each step is one call into disttrain/. Rerunning the same command resumes from the newest
complete checkpoint in output.dir (output.resume=auto).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from disttrain import guards
from disttrain.errors import DataError, exit_on_user_error


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="YAML recipe, e.g. recipes/tiny/sft.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="override any recipe field, e.g. training.max_steps=20")
    return parser.parse_args(argv)


def main(argv=None):
    # 1. The recipe, validated before any process group or model exists.
    from disttrain.config import load_recipe

    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    guards.watch(recipe.distributed.timeout_s)  # a stuck rank says where it is stuck, before the timeout

    from accelerate.utils import set_seed

    from disttrain import checkpoint, compat, data, hub, loop, modeling, optim, outputs
    from disttrain.backends import (build_accelerator, has_gpu, launcher_strategy, run_label, set_deepspeed_micro_batch,
                                    shards_weights, world_size, zero_stage)
    from disttrain.loss import TokenLoss
    from disttrain.metrics import MetricsLogger
    from disttrain.preference import PreferenceLoss, prepare_reference
    from disttrain.report import write_report
    from disttrain.samples import build_sampler

    # 2. The distributed world, as the accelerate config describes it (impossible combinations stop here).
    #    output.dir's {strategy} and {processes} are filled in: runs under other strategies do not collide.
    recipe = recipe.for_launch(run_label(), world_size())
    strategy = launcher_strategy()
    compat.check(recipe, strategy, has_gpu())
    compat.check_trackers(recipe.logging.report_to)
    hub.check_token(recipe.output.push_to_hub)  # before training, not after it
    compat.check_zero3_export(recipe, strategy)
    guards.warn_elastic_shared_store()  # torchrun restarts that would reconnect to dead workers
    guards.warn_short_shutdown_timeout()  # a preemption checkpoint the launcher would cut off after 30 s
    guards.at("creating the process group (rendezvous with the other ranks)")
    accelerator = build_accelerator(recipe)
    cfg = recipe.training
    streaming = recipe.data.streaming
    shape = checkpoint.RunShape(accelerator.num_processes, "ddp" if strategy == "single" else strategy,
                                cfg.micro_batch_size, cfg.grad_accum, streaming, zero_stage())
    checkpoint.check_fresh_start(recipe.output.dir, recipe.output.resume)  # never mix two runs' checkpoints
    resume_from = checkpoint.find(recipe.output.dir, recipe.output.resume)
    if resume_from is not None:  # fail on a bad checkpoint now, not after loading the model
        checkpoint.verify(resume_from)
        saved_state = checkpoint.check_shape(resume_from, shape)
    set_seed(cfg.seed)  # identical model init (and LoRA init) on every rank
    outputs.start(accelerator, recipe, resuming=resume_from is not None)

    # 3. Tokenizer and data: tokenised once on the main process, read from the cache by the others
    #    (a stream is tokenised on the fly by each rank, from its own shards).
    guards.at("tokenising on the main process first (the other ranks wait for it)")
    tokenizer = modeling.load_tokenizer(recipe.model)
    train_set, eval_sets, reports = data.build_datasets(recipe.data, tokenizer, cfg.seed,
                                                        accelerator.main_process_first)
    outputs.report_data(accelerator, reports, recipe.output.dir)
    if streaming:
        for note in data.shards_note(recipe.data, accelerator.num_processes):
            accelerator.print(note)

    # 4. How long: optimizer steps from data size, batch, accumulation and world size (a stream: max_steps).
    if streaming:
        per_epoch = total_steps = cfg.max_steps
    else:
        per_epoch = loop.steps_per_epoch(len(train_set), cfg.micro_batch_size, accelerator.num_processes,
                                         cfg.grad_accum)
        if per_epoch == 0:
            raise DataError(f"{recipe.data.path or 'data.sources'}: {len(train_set)} training rows cannot fill one "
                            f"optimizer step of micro_batch_size x grad_accum x processes = "
                            f"{cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes} rows")
        total_steps = cfg.max_steps or per_epoch * cfg.epochs

    # 5. Model, optimizer, schedule, loaders -> prepared for the chosen strategy.
    guards.at("loading the model")
    model = modeling.load_model(recipe.model, recipe.lora, sharded=shards_weights(accelerator),
                                local_device=accelerator.local_process_index if has_gpu() else None)
    # the objective: SFT's token loss (chunked: lm_head returns per-token losses, no full logits), or DPO's
    dpo = cfg.objective == "dpo"
    token_loss = (PreferenceLoss(model, recipe.preference, recipe.reference_mode()) if dpo
                  else TokenLoss(model, cfg.loss_impl))
    optimizer = optim.build_optimizer(model, cfg)
    scheduler = optim.build_scheduler(optimizer, cfg, total_steps)
    collator = (data.PairCollator(tokenizer.pad_token_id) if dpo else
                data.Collator(tokenizer.pad_token_id,
                              flatten_packed=data.flattens_packed_rows(recipe.model.attn_implementation)))
    eval_loaders = {name: data.make_loader(rows, cfg.micro_batch_size, collator, False, False)
                    for name, rows in eval_sets.items()}
    guards.check_initial_replicas(accelerator, model)  # same seed -> same initial weights on every rank
    guards.at("accelerator.prepare (wrapping, sharding, broadcasting the weights)")
    if streaming:  # this rank's shards, on its device; not handed to accelerate (it would re-split them)
        train_loader = data.StreamLoader(data.stream_rows(recipe.data, tokenizer, cfg.seed, accelerator.process_index,
                                                          accelerator.num_processes),
                                         cfg.micro_batch_size, collator, accelerator.device)
        set_deepspeed_micro_batch(accelerator, cfg.micro_batch_size)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        train_loader = data.make_loader(train_set, cfg.micro_batch_size, collator, recipe.data.shuffle, True, cfg.seed)
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
        assert len(train_loader) // cfg.grad_accum == per_epoch, "steps_per_epoch disagrees with accelerate's sharding"
    eval_loaders = {name: accelerator.prepare(loader) for name, loader in eval_loaders.items()}
    if cfg.neftune_alpha:  # noisy embeddings while training (transformers' own hook; eval is untouched)
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(model, cfg.neftune_alpha, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # dropout differs per rank, like the data does
    outputs.describe_run(accelerator, recipe, model, strategy, per_epoch, total_steps)
    flops_meter, peak = outputs.throughput_setup(accelerator, recipe, model)

    # 6. DPO's reference, before any update: log-probs of every pair with the initial weights (read back on
    #    resume), or a frozen copy sharded like the policy; LoRA's is the policy with its adapters disabled.
    if dpo:
        guards.at("preparing the reference (preference tuning)")
        prepare_reference(accelerator, recipe, model, token_loss, train_set, eval_sets, eval_loaders, collator)

    # 7. Resume: weights, optimizer, schedule, RNG and position exactly as they were saved.
    state = loop.TrainState()
    if resume_from is not None:
        guards.at("loading the checkpoint")
        accelerator.load_state(str(resume_from))
        state.load_state_dict(saved_state)
        if streaming:  # the stream continues where this rank's position was saved, without replaying it
            train_loader.load_state_dict(checkpoint.load_rank_state(resume_from, accelerator.process_index))
        accelerator.print(f"resumed from {resume_from} at step {state.step}/{total_steps}")
        if state.step >= total_steps and outputs.final_model_dir(recipe).is_dir():  # nothing left to do
            accelerator.print(f"run complete: {recipe.output.dir} holds all {total_steps} steps and the exported model "
                              f"({outputs.final_model_dir(recipe)}). To train again use another output.dir (or delete "
                              "this one); to train longer raise training.max_steps or training.epochs")
            accelerator.end_training()
            return state

    # 8. Train; SIGTERM (preemption, scancel) finishes the step, checkpoints and exits.
    signal.signal(signal.SIGTERM, loop.request_stop)
    accelerator.init_trackers(recipe.logging.project, config=outputs.tracker_config(recipe),
                              init_kwargs=outputs.tracker_init_kwargs(recipe))
    log = MetricsLogger(accelerator, recipe.output.dir, total_steps, initial_step=state.step)
    checkpointer = checkpoint.Checkpointer(accelerator, recipe.output.dir, recipe.output.checkpoint_every,
                                           recipe.output.checkpoint_at_end, recipe.output.keep_last, shape,
                                           rank_state=train_loader.state_dict if streaming else None,
                                           expected_bytes=checkpoint.expected_bytes(model))
    sampler = build_sampler(accelerator, model, tokenizer, recipe, eval_sets, train_set, log.log)
    state = loop.train(accelerator, model, optimizer, scheduler, train_loader, eval_loaders, cfg, log.log, state,
                       total_steps, per_epoch, recipe.logging.every_steps, progress=log.advance,
                       checkpointer=checkpointer, flops_meter=flops_meter, peak_flops=peak,
                       distributed=recipe.distributed, token_loss=token_loss, sampler=sampler)
    log.close()
    if state.step < total_steps:
        accelerator.print(f"stopped at step {state.step}/{total_steps}; checkpoint {checkpointer.last_saved}. "
                          "Run the same command again to resume.")
        accelerator.end_training()
        return state

    # 9. What was learned, in one line: a prompt and the trained model's answer (generated by every rank).
    if sampler is not None:
        if not sampler.last:  # no evaluation ran
            sampler(state.step)
        if sampler.last:
            accelerator.print(f"sample: {sampler.last[0]['prompt']!r} -> {sampler.last[0]['completion']!r}")

    # 10. Export a standard HF model dir (full weights, or the LoRA adapter).
    if recipe.output.save_final_model:
        guards.at("exporting the final model", state.step)
        final = modeling.export(accelerator, model, tokenizer, outputs.final_model_dir(recipe), recipe.model,
                                merge_lora=bool(recipe.lora and recipe.lora.merge_on_export))
        accelerator.print(f"final model: {final}  (metrics: {log.path})")
    if recipe.output.report and accelerator.is_main_process:  # model card and plots, from the run's own files
        written = write_report(recipe.output.dir)
        accelerator.print(f"report: {', '.join(str(p) for p in written if p.name in ('overview.png', 'README.md'))}"
                          f"  (again, or for several runs: make report RUN={recipe.output.dir})")
    guards.at("waiting for all ranks to finish", state.step)
    accelerator.wait_for_everyone()  # leave together: a rank tearing down early can abort a slower one
    accelerator.end_training()
    if recipe.output.push_to_hub and accelerator.is_main_process:  # after the others left: no collective waits
        accelerator.print(f"pushed to {hub.push(outputs.final_model_dir(recipe), recipe.output.push_to_hub)}")
    return state


if __name__ == "__main__":
    with exit_on_user_error(), guards.collective_failures_explained():
        main(sys.argv[1:])
    # Everything is written and the process group and trackers are closed. Skip interpreter teardown:
    # there a C++ thread of the distributed stack sometimes aborts a finished rank ("terminate called
    # without an active exception", SIGABRT), which fails the whole launch after a good run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Worker for `make bench-overhead`: the same data, model and batch as train.py, trained by
  raw      a minimal PyTorch DDP loop (the overhead floor: no accelerate, no metrics, plain mean loss), or
  trainer  transformers' Trainer (what users would otherwise pick).
Launched with `accelerate launch --config_file accelerate_configs/ddp.yaml scripts/bench/peers.py MODE ...`.
Rank 0 writes {"tokens_per_s_per_device": ...} (non-padding tokens, steps after warm-up) to --result.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from disttrain import data  # noqa: E402
from disttrain.model import loading as modeling
from disttrain.recipe.schema import load_recipe  # noqa: E402
from disttrain.runtime import guards  # noqa: E402


def setup(args):
    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = modeling.load_tokenizer(recipe.model)
    from contextlib import nullcontext

    train_set, _, _ = data.build_datasets(recipe.data, tokenizer, recipe.training.seed, nullcontext)
    return recipe, tokenizer, train_set


def strip(batch):
    return {k: v for k, v in batch.items() if k not in data.BOOKKEEPING_KEYS}


def raw_loop(args):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe, tokenizer, train_set = setup(args)
    cfg = recipe.training
    torch.manual_seed(cfg.seed)
    model = modeling.load_model(recipe.model, recipe.lora)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)
    guards.hold_until_exit(ddp, optimizer)  # freed at os._exit, not when raw_loop returns: guards says why
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.seed,
                                                              drop_last=True)
    loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.micro_batch_size, sampler=sampler, drop_last=True,
                                         collate_fn=data.Collator(tokenizer.pad_token_id))
    def forever():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    batches = forever()
    tokens, started = 0, None
    for step in range(args.steps):
        if step == args.warmup:
            tokens, started = 0, time.perf_counter()
        for micro in range(cfg.grad_accum):
            batch = next(batches)
            tokens += int(batch[data.LENGTHS_KEY].sum())
            context = ddp.no_sync() if micro < cfg.grad_accum - 1 else torch.enable_grad()
            with context:
                loss = ddp(**strip(batch), use_cache=False).loss / cfg.grad_accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.max_grad_norm or 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    if rank == 0:
        Path(args.result).write_text(json.dumps({"tokens_per_s_per_device": tokens / elapsed}))
    dist.destroy_process_group()


def trainer(args):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    recipe, tokenizer, train_set = setup(args)
    cfg = recipe.training
    counted = []
    collate = data.Collator(tokenizer.pad_token_id)

    def collator(rows):
        batch = collate(rows)
        counted.append(int(batch[data.LENGTHS_KEY].sum()))
        return strip(batch)

    class Timer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            if state.global_step == args.warmup:
                self.started, self.batches_before = time.perf_counter(), len(counted) - 1  # one batch prefetched

        def on_train_end(self, _args, state, control, **kwargs):
            self.elapsed = time.perf_counter() - self.started

    timer = Timer()
    training_args = TrainingArguments(
        output_dir=str(Path(args.result).parent / "trainer_out"), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum, max_steps=args.steps, learning_rate=cfg.lr,
        max_grad_norm=cfg.max_grad_norm or 1.0, logging_steps=10**9, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True, remove_unused_columns=False, seed=cfg.seed,
        disable_tqdm=True)
    model = modeling.load_model(recipe.model, recipe.lora)
    hf = Trainer(model=model, args=training_args, train_dataset=train_set, data_collator=collator, callbacks=[timer])
    guards.hold_until_exit(hf)  # its DDP model owns a reference to the process group, as in train.py
    hf.train()
    tokens = sum(counted[timer.batches_before: timer.batches_before + (args.steps - args.warmup) * cfg.grad_accum])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps({"tokens_per_s_per_device": tokens / timer.elapsed}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["raw", "trainer"])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    raw_loop(a) if a.mode == "raw" else trainer(a)
    # Like train.py: skip interpreter teardown, where torch 2.13's distributed stack sometimes aborts a rank
    # that has finished ("terminate called without an active exception"; seen here after raw.json was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

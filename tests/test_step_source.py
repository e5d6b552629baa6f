"""The step-source seam (training/loop.StepSource, objectives/base.Objective.steps): an objective may make each
step's batches itself, here by generating with the current model before every step (what online RL's rollouts
do, without rewards), and the loop trains on them unchanged. In one process: the loop, the hooks and the step
source are the code train.py runs; only the objective is the test's."""

import math

import torch

from conftest import base_recipe, write_recipe
from disttrain import data
from disttrain.data.feed import LoaderSteps, steps_per_epoch
from disttrain.model import loading
from disttrain.objectives.token_loss import TokenLoss
from disttrain.recipe.schema import load_recipe
from disttrain.training import loop
from disttrain.training.hooks import MetricsLine

PROMPT, NEW = 6, 4  # each row's first 6 tokens are the prompt; 4 greedy tokens are generated and learned


class GenerateThenTrain:
    """Over the feed's rows: before every step, each row's prompt is completed greedily by the model as it is
    now, and the step learns the completion (prompt tokens masked)."""

    def __init__(self, feed, collator):
        self.feed, self.collator, self.total_steps = feed, collator, feed.total_steps
        self.weights_seen: list[float] = []  # a checksum of the weights each step generated with

    def windows(self, run, state):
        for micro_batches in self.feed.windows(run, state):
            model = run.accelerator.unwrap_model(run.model)
            self.weights_seen.append(sum(float(p.double().sum()) for p in model.parameters()))
            yield [self._rollout(model, batch) for batch in micro_batches]

    @torch.no_grad()
    def _rollout(self, model, batch: dict) -> dict:
        prompts = batch["input_ids"][:, :PROMPT]
        model.eval()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        model.train()
        return self.collator([{"input_ids": row.tolist(), "labels": [-100] * PROMPT + row[PROMPT:].tolist()}
                              for row in out])


def test_an_objective_that_generates_before_every_step_trains_through_the_unchanged_loop(tmp_path, tiny_model_dir):
    from disttrain.runtime.backends import build_accelerator

    steps, micro, accumulation = 3, 2, 2
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, tmp_path / "run", data={"shuffle": False},
        training={"micro_batch_size": micro, "grad_accum": accumulation, "max_steps": steps, "lr": 1e-2})))
    accelerator = build_accelerator(recipe)
    tokenizer = loading.load_tokenizer(recipe.model)
    train_set, _, _ = data.build_datasets(recipe.data, tokenizer, 0, accelerator.main_process_first)
    model = loading.load_model(recipe.model, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    collator = data.Collator(tokenizer.pad_token_id)
    loader = data.make_loader(train_set, micro, collator, False, True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    per_epoch = steps_per_epoch(len(train_set), micro, 1, accumulation)
    source = GenerateThenTrain(LoaderSteps(loader, per_epoch, steps), collator)
    token_loss = TokenLoss(model, "chunked")
    run = loop.Run(accelerator, loop.Trainable(model, optimizer, scheduler), token_loss, source, recipe)
    records = []
    state = loop.train(run, loop.TrainState(), [MetricsLine(accelerator, token_loss, scheduler, 1, None)],
                       lambda record, step: records.append({**record, "step": step}))

    assert state.step == steps and [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    # only the generated tokens are learned: micro-batch rows x accumulation x new tokens per step
    assert [r["target_tokens"] for r in records] == [micro * accumulation * NEW] * steps
    # each step generated with the weights the previous step left: three different models, in order
    assert len(source.weights_seen) == steps and len(set(source.weights_seen)) == steps

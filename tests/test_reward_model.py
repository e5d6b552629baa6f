"""Reward-model training (training.objective: reward) and its use as an online-RL reward:

- the loss and every gradient equal TRL 1.16's own RewardTrainer.compute_loss on the same model and pairs (with
  and without the centring term);
- the tiny recipe learns its preference (eval pair accuracy > 0.9); its final/ loads with transformers'
  AutoModelForSequenceClassification (full) or peft's AutoPeftModelForSequenceClassification (LoRA: the score head
  saved in full beside the adapters) and scores the chosen answer above the rejected one as the run did;
- that export scores completions as a GRPO reward (rl.rewards[].model) under DDP: the scores are the model's own
  on the chat-rendered prompt + completion;
- what the objective cannot take is refused in one line.
(Every data-parallel config against one process: tests/test_matrix.py's `reward` runs.)
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.data import PairCollator
from disttrain.errors import RecipeError
from disttrain.metrics.log import read_metrics
from disttrain.objectives.reward_model import BradleyTerryLoss
from disttrain.recipe.schema import load_recipe

trl_reward = pytest.importorskip("trl.trainer.reward_trainer")


def _score_model(tiny_model_dir, pad_token_id):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    return AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=pad_token_id,
                                                              dtype=torch.float32)


def _pairs(tokenizer) -> dict:
    def row(text, index):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ids
    rows = []
    for i, (good, bad) in enumerate([("green stone", "STONE GREEN!"), ("4", "seven"), ("a b c", "c")]):
        rows.append({"chosen_input_ids": row("sort: " + good, i), "chosen_labels": row("sort: " + good, i),
                     "rejected_input_ids": row("sort: " + bad, i), "rejected_labels": row("sort: " + bad, i),
                     "pair_index": i})
    return PairCollator(tokenizer.pad_token_id)(rows)


@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_and_gradients_equal_trls_reward_trainer(center, tiny_model_dir, tokenizer):
    batch = _pairs(tokenizer)
    theirs_model, ours_model = (_score_model(tiny_model_dir, tokenizer.pad_token_id) for _ in range(2))
    one = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    args = SimpleNamespace(center_rewards_coefficient=center)
    stub = SimpleNamespace(model=SimpleNamespace(training=True), args=args, accelerator=one,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    theirs = trl_reward.RewardTrainer.compute_loss(stub, theirs_model, {"input_ids": batch["input_ids"],
                                                                       "attention_mask": batch["attention_mask"]})
    loss = BradleyTerryLoss(center)
    ours = loss.training_loss(ours_model, batch, loss.units(batch).float())
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    theirs.backward()
    ours.backward()
    for (name, mine), (_, trl) in zip(ours_model.named_parameters(), theirs_model.named_parameters()):
        torch.testing.assert_close(mine.grad, trl.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert stub._metrics["train"]["accuracy"][0] == pytest.approx(loss.window_metrics(
        SimpleNamespace(reduce=lambda x, reduction: x, device="cpu"))["rewards/accuracy"])


def _reward_recipe(tmp_path, tiny_model_dir, name, **sections):
    tree = base_recipe(tiny_model_dir, tmp_path / name,
                       data={"path": str(REPO / "data/tiny_dpo.jsonl"), "format": "preference",
                             "eval_path": str(REPO / "data/tiny_dpo_eval.jsonl")},
                       training={"objective": "reward", "max_steps": 30, "micro_batch_size": 8, "grad_accum": 1,
                                 "eval_every": 30, "lr": 3e-3},
                       reward_model={"center_rewards_coefficient": 0.01})
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return write_recipe(tmp_path / f"{name}.yaml", tree)


def _chat_pair(record: dict) -> tuple[list, list]:
    return record["prompt"] + record["chosen"], record["prompt"] + record["rejected"]


def test_a_trained_reward_model_exports_loads_and_scores_online_rl_completions(tmp_path, tiny_model_dir, tokenizer):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification

    # trained padding-free (data.packing): the pairs' sequences share rows, each score read at its last token
    full = _reward_recipe(tmp_path, tiny_model_dir, "full", data={"packing": True})
    adapters = _reward_recipe(tmp_path, tiny_model_dir, "lora", lora={"r": 8, "dropout": 0.0}, data={"packing": True})
    for recipe in (full, adapters):
        assert_ok(launch("single_gpu", recipe, nproc=1))
    last_eval = [r for r in read_metrics(tmp_path / "full") if "eval_rewards/accuracy" in r][-1]
    assert last_eval["eval_rewards/accuracy"] > 0.9
    record = json.loads((REPO / "data/tiny_dpo.jsonl").read_text().splitlines()[0])
    chosen, rejected = (tokenizer.apply_chat_template(m, tokenize=False) for m in _chat_pair(record))
    for model in (AutoModelForSequenceClassification.from_pretrained(tmp_path / "full" / "final"),
                  AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "lora" / "final", num_labels=1)):
        inputs = tokenizer([chosen, rejected], return_tensors="pt", padding=True, add_special_tokens=False)
        scores = model.eval()(**inputs).logits[:, 0]
        assert scores[0] > scores[1]

    # the full model as online RL's reward: 3 steps, scored by it, under DDP and under ZeRO-3 (with and without
    # offload: the reward model is loaded whole there too, not partitioned), the same scores at every step
    scores = {}
    for strategy in ("ddp", "zero3", "zero3_offload"):
        grpo = base_recipe(tiny_model_dir, tmp_path / f"grpo-{strategy}",
                           data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt"},
                           training={"objective": "grpo", "micro_batch_size": 1, "grad_accum": 1, "max_steps": 3},
                           rl={"num_generations": 4, "max_completion_length": 6,
                               "rewards": [{"model": str(tmp_path / "full" / "final")}]})
        assert_ok(launch(strategy, write_recipe(tmp_path / f"grpo-{strategy}.yaml", grpo)))
        lines = [r for r in read_metrics(tmp_path / f"grpo-{strategy}") if "reward" in r]
        assert [r["step"] for r in lines] == [1, 2, 3] and all("rewards/reward_model/mean" in r for r in lines)
        scores[strategy] = [(r["reward"], r["rewards/reward_model/std"]) for r in lines]
    assert scores["zero3"] == pytest.approx(scores["ddp"], rel=1e-5)
    assert scores["zero3_offload"] == pytest.approx(scores["ddp"], rel=1e-5)

    from disttrain.objectives.rewards import RewardModel

    scorer = RewardModel(str(tmp_path / "full" / "final"), "rl.rewards[0]")
    prompt = [{"role": "user", "content": "Sort the words alphabetically. stone green"}]
    completions = [[{"role": "assistant", "content": "green stone"}], [{"role": "assistant", "content": "STONE!"}]]
    ours = scorer([prompt, prompt], completions)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "full" / "final").eval()
    for completion, score in zip(completions, ours):
        text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        alone = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
        assert score == pytest.approx(float(alone), abs=1e-5)  # padding in a batch changes nothing
    assert ours[0] > ours[1]


def test_what_a_reward_model_cannot_take_is_refused_in_one_line(tmp_path, tiny_model_dir):
    cases = {"needs data.format: preference": {"data": {"path": str(REPO / "data/tiny_alpaca.jsonl"),
                                                        "format": "alpaca"}},
             "concat_and_chunk and streaming are not supported": {"data": {"streaming": True}},
             "generates no text for lm-eval": {"evaluation": {"tasks": ["x"], "every_steps": 2},
                                               "output": {"checkpoint_every": 2}},
             "does not apply to training.objective: reward": {"training": {"loss_impl": "plain"}}}
    for says, sections in cases.items():
        path = _reward_recipe(tmp_path, tiny_model_dir, "r", **sections)
        with pytest.raises(RecipeError, match=says):
            load_recipe(path)
    bad = base_recipe(tiny_model_dir, tmp_path / "g", data={"path": str(REPO / "data/tiny_prompts.jsonl"),
                                                            "format": "prompt"},
                      training={"objective": "grpo"}, rl={"rewards": [{"function": "a:b", "model": "m"}]})
    with pytest.raises(RecipeError, match="give function .* or model"):
        load_recipe(write_recipe(tmp_path / "g.yaml", bad))

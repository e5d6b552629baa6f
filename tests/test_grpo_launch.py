"""Online RL launched as a user launches it (each strategy against one process: tests/test_matrix.py's `rl` runs):

- the shipped tiny recipe's reward rises under DDP (the last fifth of its logged steps against the first);
- a run resumed from a checkpoint repeats the uninterrupted run's steps exactly (rewards, losses, KL, weights):
  between two prompt batches (DDP, ZeRO-3), and between two iterations on the same completions (FSDP2 with
  rl.num_iterations: 2, the completions travel in the checkpoint);
- a reward function needing a column the data lacks stops before the model loads, and one that raises stops at
  the completion it raised on: one line each, no traceback, exit code 2.
"""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics

pytestmark = pytest.mark.launch

REWARDS = [{"function": "recipes/tiny/rewards.py:letters"}, {"function": "recipes/tiny/rewards.py:answer_words"}]
COMPARED = ("loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length", "rewards/letters/mean",
            "rewards/answer_words/mean", "clip_ratio/region_mean")


def grpo_recipe(tmp_path, model_dir, name, rl=None, training=None, output=None, data=None):
    tree = base_recipe(model_dir, tmp_path / name,
                       data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt", **(data or {})},
                       training={"objective": "grpo", "micro_batch_size": 1, "grad_accum": 2, "max_steps": 6,
                                 "lr": 5e-3, **(training or {})},
                       rl={"num_generations": 4, "max_completion_length": 8, "rewards": REWARDS, **(rl or {})},
                       output={"checkpoint_every": 3, "keep_last": 4, **(output or {})})
    return write_recipe(tmp_path / f"{name}.yaml", tree)


def test_the_tiny_recipes_reward_rises_under_ddp(tmp_path):
    overrides = [f"output.dir={tmp_path / 'run'}", "logging.report_to=[none]", "output.report=false"]
    proc = launch("ddp", REPO / "recipes/tiny/grpo.yaml", overrides=overrides)
    assert_ok(proc)
    rewards = [r["reward"] for r in read_metrics(tmp_path / "run") if "reward" in r]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert len(rewards) >= 25 and last > first + 0.05 and last > 2 * first, rewards


def _compared(out, from_step=1):
    return {(r["step"], k): v for r in read_metrics(out) for k, v in r.items() if k in COMPARED and
            r["step"] >= from_step}


@pytest.mark.parametrize("strategy, iterations", [("ddp", 1), ("fsdp", 2), ("zero3", 1)])
def test_a_resumed_run_repeats_the_uninterrupted_one(strategy, iterations, tmp_path, tiny_model_dir):
    rl = {"num_iterations": iterations, "beta": 0.05, "loss": "dapo"}
    steps = 6 if iterations == 1 else 3  # batches of prompts: 6 optimizer steps either way
    first = grpo_recipe(tmp_path, tiny_model_dir, "a", rl=rl, training={"max_steps": steps})
    assert_ok(launch(strategy, first))
    a = tmp_path / "a"
    resumed = grpo_recipe(tmp_path, tiny_model_dir, "b", rl=rl, training={"max_steps": steps})
    second = launch(strategy, resumed, overrides=[f"output.resume={a / 'checkpoints' / 'step-00000003'}"])
    assert_ok(second)
    assert "at step 3/6" in second.stdout
    theirs, ours = _compared(a, from_step=4), _compared(tmp_path / "b", from_step=4)
    assert {s for s, _ in ours} == {4, 5, 6} and ("reward" in {k for _, k in ours})
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-8)
    wa, wb = (load_file(str(run / "final" / "model.safetensors")) for run in (a, tmp_path / "b"))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


def _train(recipe):
    return subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", str(recipe)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_reward_functions_going_wrong_stop_the_run_in_one_line(tmp_path, tiny_model_dir):
    module = tmp_path / "rewards.py"
    module.write_text("def needs_solution(completions, solution, **kw):\n    return [0.0] * len(completions)\n\n"
                      "def fails(completions, answer, **kw):\n"
                      "    return [float(len(c[0]['content']) / (a.count(' ') - 2)) for c, a in zip(completions, "
                      "answer)]\n")
    missing = _train(grpo_recipe(tmp_path, tiny_model_dir, "a", rl={"rewards": [
        {"function": f"{module}:needs_solution"}]}))
    line = _one_error_line(missing)
    assert "rl.rewards[0] (needs_solution) needs the column 'solution'" in line and "answer" in line
    assert "Loading weights" not in missing.stderr + missing.stdout  # stopped before the model loads
    raising = _train(grpo_recipe(tmp_path, tiny_model_dir, "b", rl={"rewards": [{"function": f"{module}:fails"}]}))
    line = _one_error_line(raising)
    assert "rl.rewards[0] (fails) raised ZeroDivisionError" in line and "completion 0 of training row" in line

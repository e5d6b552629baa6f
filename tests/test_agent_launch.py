"""Online RL with a tool, launched as a user would: the tiny model warm-started by SFT on the shipped tool-calling
transcripts (recipes/tiny/tool_sft.yaml, shortened), then GRPO with recipes/tiny/tools.py:lookup (recipes/tiny/
tool_grpo.yaml, shortened: these runs are the two recipes' preflight, tests/test_preflight.py) under every
data-parallel config -- DDP stopped after step 2 and resumed, FSDP2 and HSDP gathering each layer per token
(generate() synced: the ranks agree on every turn's calls), ZeRO-3 with the task as an environment -- each equal
to one process step by step (loss, rewards, the tools' counts), tools called and their replies inside the logged
trajectories, the final model loading; and ZeRO-3's run again through `make train-zero3`, the real launcher."""

from __future__ import annotations

import pytest

from conftest import REPO, assert_ok, launch
from disttrain.metrics.log import read_metrics
from disttrain.recipe.matrix import COLUMNS

COLUMN = {c.config: c for c in COLUMNS}

pytestmark = pytest.mark.launch

STEPS = 4
# What each config's run adds (its one-process reference runs the same, less what does not change the samples):
# FSDP2 and HSDP gather each layer per token (generate() synced: the ranks agree on every turn's calls), the
# others gather the whole model once (ZeRO-3 + offload's per-layer decoding takes 40 s here, for no path the
# others miss); ZeRO-2 samples a turn in several generate calls; ZeRO-3 plays the task as an environment
# (recipes/tiny/tools.py:CodeBook: reset with each prompt's record, its method the tool, its get_reward a second
# reward)
VARIANT = {"ddp": {}, "fsdp": {"generation_weights": "per_layer"}, "fsdp_offload": {},
           "hsdp": {"generation_weights": "per_layer"}, "zero1": {}, "zero2": {"rows_per_generate": 3},
           "zero3": {"environment": "recipes/tiny/tools.py:CodeBook", "tools": "[]"},
           "zero3_offload": {}}
SAME_SAMPLES = ("generation_weights", "rows_per_generate")


# The shipped recipes, shortened: what a run here may not write or wait for (a report, samples, trackers)
QUIET = ("logging.report_to=[none]", "logging.samples=0", "output.report=false", "output.checkpoint_minutes=30")


@pytest.fixture
def tool_model_dir(runs, tiny_model_dir):
    """recipes/tiny/tool_sft.yaml on the tiny model, 120 of its steps: the model calls the tool in most answers at
    the rollouts' temperature (some calls malformed: the failure path runs too)."""
    def make(folder):
        assert_ok(launch("single_gpu", REPO / "recipes/tiny/tool_sft.yaml", nproc=1, overrides=(
            *QUIET, f"model.name_or_path={tiny_model_dir}", f"output.dir={folder}/sft", "training.max_steps=120",
            "logging.every_steps=50")))
        return folder / "sft" / "final"
    return runs.get("agent-tool-sft", make)


def overrides_of(model, out, processes: int, variant: dict) -> tuple[str, ...]:
    """The shipped recipe shortened: 4 steps of 4 prompts x 4 trajectories at temperature 0.5 into `out`."""
    return (*QUIET, f"model.name_or_path={model}", f"output.dir={out}", f"training.max_steps={STEPS}",
            "training.micro_batch_size=1", f"training.grad_accum={4 // processes}", "training.lr=2e-4",
            "rl.num_generations=4", "rl.temperature=0.5", "logging.every_steps=1",
            *(f"rl.{k}={v}" for k, v in variant.items()))


def agent_run(runs, model, config: str, variant: dict):
    """recipes/tiny/tool_grpo.yaml from `model`, 4 steps of 4 prompts x 4 trajectories at temperature 0.5, under
    `config` with `variant`; ddp's made in two invocations (stopped after step 2, then resumed)."""
    def make(folder):
        processes = COLUMN[config].processes
        overrides = overrides_of(model, f"{folder}/{config}", processes, variant)
        recipe = REPO / "recipes/tiny/tool_grpo.yaml"
        if config == "ddp":
            assert_ok(launch(config, recipe, nproc=processes, overrides=(*overrides, "training.stop_at_step=2")))
        assert_ok(launch(config, recipe, nproc=processes, overrides=overrides))
        return folder / config
    return runs.get(f"agent-{config}" + "".join(f"-{k}" for k in sorted(variant)), make)


COMPARED = ("loss", "reward", "rewards/code_answer/mean", "rewards/CodeBook/mean", "tools/call_frequency",
            "tools/failure_frequency", "tools/turns", "tools/tool_tokens", "completions/mean_length", "entropy")


def metrics(out) -> dict[tuple[int, str], float]:
    return {(r["step"], k): r[k] for r in read_metrics(out) for k in COMPARED if k in r}


@pytest.mark.parametrize("config", list(VARIANT))
def test_rollouts_with_a_tool_train_like_one_process(runs, tool_model_dir, config):
    from transformers import AutoModelForCausalLM

    variant = VARIANT[config]
    single = agent_run(runs, tool_model_dir, "single_gpu", {k: v for k, v in variant.items() if k not in SAME_SAMPLES})
    out = agent_run(runs, tool_model_dir, config, variant)
    ours, theirs = metrics(out), metrics(single)
    assert sorted(ours) == sorted(theirs) and {s for s, _ in ours} == set(range(1, STEPS + 1))
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    calls = [v for (_, k), v in theirs.items() if k == "tools/call_frequency"]
    assert min(calls) > 0.3, calls  # the tool is called on every step, its replies trained around
    assert all(v > 0 for (_, k), v in theirs.items() if k == "tools/tool_tokens")
    logged = [c["completion"] for r in read_metrics(out) for c in r.get("completions", [])]
    assert any("<|im_start|>tool\n" in c for c in logged), logged[:2]  # a tool's reply inside a trajectory
    if "environment" in variant:  # its own reward, beside the function's: the right word looked up
        assert any(v > 0 for (_, k), v in theirs.items() if k == "rewards/CodeBook/mean")
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_the_real_launcher_plays_tools_as_the_warm_one(runs, tool_model_dir, tmp_path):
    """`make train-zero3` (accelerate launch as a user types it) with the environment: every step as the warm
    launcher's run."""
    from disttrain.recipe.schema import load_recipe, recipe_to_dict
    from strategy_runs import make_train

    variant = VARIANT["zero3"]
    recipe = load_recipe(REPO / "recipes/tiny/tool_grpo.yaml", overrides_of(tool_model_dir, tmp_path / "run", 2,
                                                                             variant))
    path = tmp_path / "tool_grpo.yaml"
    path.write_text(__import__("yaml").safe_dump(recipe_to_dict(recipe), sort_keys=False))
    assert "processes=2" in make_train("train-zero3", path, "GPUS=2")
    warm = metrics(agent_run(runs, tool_model_dir, "zero3", variant))
    ours = metrics(tmp_path / "run")
    assert sorted(ours) == sorted(warm)
    for key, value in warm.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key

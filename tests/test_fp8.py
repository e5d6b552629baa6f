"""training.mixed_precision: fp8 — torchao's float8 linear layers through accelerate's torchao recipe, emulated on
CPU (the same float8 casts and scales, the products in high precision): which layers convert, the loss against
bf16's over 50 steps, the plain model exported, and the launches equal to one process (DDP exactly, across a
resume; FSDP2, whose bf16 weights are cast to float8, within the matrix's noise tolerance)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, launch, launch_command, real_launcher, write_recipe
from disttrain.metrics.log import read_metrics
from disttrain.recipe import matrix
from disttrain.runtime import fp8

STEPS = 50
# docs/strategies.md, "FP8": emulated FP8 against bf16 on the tiny recipe, the mean loss of every 10 steps
TOLERANCE = 0.03
PER_STEP = 0.08  # one step's loss on 4 rows: the two precisions' rounding moves single batches further


def _run(folder, model_dir, precision: str, config: str = "single_gpu", overrides=(), real: bool = False):
    """The tiny recipe, 4 rows a step (one process: 2 x 2 micro-batches; two: one micro-batch of 2 rows each, the
    same micro-batches, so the same float8 scales); `real`: through `accelerate launch` itself, fresh interpreters
    importing torchao as a user's do (not the warm launcher's forked workers)."""
    processes = 1 if config == "single_gpu" else 2
    out = folder / f"{precision}-{config}"
    recipe = write_recipe(folder / f"{out.name}.yaml", base_recipe(
        model_dir, out, training={"max_steps": STEPS, "micro_batch_size": 2, "grad_accum": 2 // processes,
                                  "mixed_precision": precision, "lr": 2e-3}))
    if real:
        cmd = real_launcher(launch_command(config, processes, "train.py", "--recipe", str(recipe), *overrides))
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        proc = launch(config, recipe, nproc=processes, overrides=overrides)
    assert_ok(proc)
    return out, proc.stdout


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def test_the_rule_keeps_the_head_routers_and_unaligned_layers():
    """Converted: every aligned projection; kept: the output heads, a mixture of experts' router, what does not
    divide by 16."""
    cases = {"model.layers.0.self_attn.q_proj": (64, 64, True), "model.layers.1.mlp.down_proj": (176, 64, True),
             "model.layers.0.self_attn.k_proj": (64, 32, True), "lm_head": (64, 512, False),
             "score": (64, 16, False), "model.layers.0.mlp.gate": (64, 128, False),
             "model.layers.0.mlp.router": (64, 32, False), "model.layers.0.mlp.up_proj": (64, 100, False)}
    for fqn, (n_in, n_out, expected) in cases.items():
        assert fp8.converts(torch.nn.Linear(n_in, n_out), fqn) is expected, fqn
    assert not fp8.converts(torch.nn.Embedding(512, 64), "model.embed_tokens")


def test_what_fp8_cannot_take_is_refused_in_one_line(monkeypatch):
    """Beside the configs (the matrix's row): other objectives, adapters, a GPU without FP8 matmuls (accelerate
    would train in fp16 there), torchao missing."""
    from disttrain.errors import DisttrainError
    from disttrain.recipe.schema import load_recipe

    def refused(overrides, label="ddp", gpu=False) -> str:
        recipe = load_recipe(REPO / "recipes/tiny/sft.yaml", ["training.mixed_precision=fp8", *overrides])
        with pytest.raises(DisttrainError) as caught:
            fp8.check(recipe, label, gpu)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    fp8.check(load_recipe(REPO / "recipes/tiny/sft.yaml", ["training.mixed_precision=fp8"]), "fsdp", False)
    assert "under zero3 (proven: one process" in refused([], label="zero3")
    assert "with a lora section" in refused(["lora.r=8"])
    grpo = ["training.objective=grpo", "data.path=data/tiny_prompts.jsonl", "data.format=prompt",
            "data.eval_path=null", "training.eval_every=null",
            "rl.rewards=[{function: recipes/tiny/rewards.py:letters}]"]
    assert "with training.objective=grpo" in refused(grpo)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert "A100-SXM4-80GB has (8, 0), where accelerate would silently train in fp16" in refused([], gpu=True)
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)  # not installed: its import fails
    assert "needs torchao (the fp8 extra" in refused([])


@pytest.mark.launch
def test_fp8_trains_like_bf16_and_exports_the_plain_model(runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    (f8, stdout), (b16, _) = (runs.get(f"fp8-{p}", lambda folder, p=p: _run(folder, tiny_model_dir, p))
                              for p in ("fp8", "bf16"))
    assert "run: fp8: 14 of 15 linear layers compute in float8 (tensorwise dynamic scales, emulated on CPU); kept " \
           "in high precision: lm_head" in stdout
    ours, theirs = _losses(f8), _losses(b16)
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= PER_STEP * b, (step, a, b)
    for start in range(0, STEPS, 10):
        a, b = (sum(x[start:start + 10]) / 10 for x in (ours, theirs))
        assert abs(a - b) <= TOLERANCE * b, (start, a, b)
    assert sum(ours[-10:]) / 10 < 0.8 * ours[0]  # it learns
    model = AutoModelForCausalLM.from_pretrained(f8 / "final")  # the family's own layers, the model's dtype
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert model.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(b16 / "final").state_dict()
    assert set(model.state_dict()) == set(reference)


@pytest.mark.launch
def test_a_bf16_model_trained_in_fp8_exports_in_bf16(tiny_model_dir, tmp_path):
    """Weights stored in bf16 (as published models are): the float8 layers train them, final/ holds them in bf16."""
    from transformers import AutoModelForCausalLM

    out, stdout = _run(tmp_path, tiny_model_dir, "fp8", overrides=["model.dtype=bfloat16", "training.max_steps=3"])
    assert "run: fp8: 14 of 15 linear layers compute in float8" in stdout
    assert len(_losses(out)) == 3
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype="auto")
    assert model.dtype == torch.bfloat16
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}


@pytest.mark.launch
def test_fp8_under_ddp_resumes_equal_to_one_process(runs, tiny_model_dir, tmp_path):
    """Stopped after step 3 and launched again to step 6: every step equal to one process's (the same
    micro-batches: the same float8 scales), the checkpoint holding the float8 layers' weights."""
    single, _ = runs.get("fp8-fp8", lambda folder: _run(folder, tiny_model_dir, "fp8"))
    _run(tmp_path, tiny_model_dir, "fp8", "ddp", overrides=["training.stop_at_step=3"])
    out, _ = _run(tmp_path, tiny_model_dir, "fp8", "ddp", overrides=["training.stop_at_step=6"])
    steps = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert sorted(steps) == list(range(1, 7))
    assert list(steps.values()) == pytest.approx(_losses(single)[:6], rel=1e-4)


@pytest.mark.launch
def test_fp8_under_fsdp2_trains_like_one_process(runs, tiny_model_dir, tmp_path):
    """FSDP2 all-gathers bf16 weights (accelerate's policy for fp8), which are then cast to float8: the losses of
    one process within the matrix's noise tolerance. Through the real launcher: its workers get
    FSDP_CPU_RAM_EFFICIENT_LOADING=true from fsdp.yaml, which accelerate refuses beside torchao (every rank then
    loads the model whole: runtime/fp8.py)."""
    single, _ = runs.get("fp8-fp8", lambda folder: _run(folder, tiny_model_dir, "fp8"))
    out, stdout = _run(tmp_path, tiny_model_dir, "fp8", "fsdp", overrides=["training.stop_at_step=6"], real=True)
    assert "run: fp8: 14 of 15 linear layers compute in float8" in stdout
    ours = _losses(out)
    assert len(ours) == 6
    for a, b in zip(ours, _losses(single)):
        assert abs(a - b) <= matrix.NOISE_TOLERANCE * b, (a, b)

"""Preference tuning under every strategy, launched as a user would: each strategy trains the model a single
process trains (per-step loss, reward metrics, exported weights), full (precomputed reference) and LoRA (the
adapters disabled as the reference); padding-free pairs (data.packing) train what padded ones train (full
fine-tuning under PADDING_FREE's strategies and the live reference's, against the padded single process); a
stopped run resumes exactly and does not recompute the reference; the
shipped tiny recipe learns its preference (accuracy above 0.9), with the metrics in metrics.jsonl and
TensorBoard. Tolerances as in test_strategies.py (fp32: only summation order differs)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics

pytestmark = pytest.mark.launch

STEPS = 10
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
# full fine-tuning's runs under these strategies are padding-free (data.packing), the single process's padded
PADDING_FREE = ("fsdp_offload", "zero2", "zero3_offload")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen")


@pytest.fixture
def pairs(runs):
    """48 training pairs, and 16 held-out pairs beside them (pairs.eval.jsonl) for the evaluations."""
    def make(folder):
        (folder / "pairs.eval.jsonl").write_text(
            "".join((REPO / "data/tiny_dpo_eval.jsonl").read_text().splitlines(keepends=True)[:16]))
        path = folder / "pairs.jsonl"
        path.write_text("".join((REPO / "data/tiny_dpo.jsonl").read_text().splitlines(keepends=True)[:48]))
        return path
    return runs.get("dpo-pairs", make)


def recipe_for(tmp_path, model_dir, data, name, micro, lora, **output):
    sections = dict(data={"path": str(data), "format": "preference", "max_seq_len": 64,
                          "eval_path": str(data.with_suffix(".eval.jsonl"))},
                    training={"objective": "dpo", "max_steps": STEPS, "micro_batch_size": micro, "grad_accum": 2,
                              "lr": 3e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "eval_every": 5},
                    preference={"loss": "sigmoid", "beta": 0.5}, output=output)
    if lora:
        sections["lora"] = LORA
    return write_recipe(tmp_path / f"{name}.yaml", base_recipe(model_dir, tmp_path / name, **sections))


def lines(out, key):
    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


def weights(out, lora):
    return load_file(out / "final" / ("adapter_model.safetensors" if lora else "model.safetensors"))


def assert_same(a, b, rel, atol, accuracy=True, from_step=1):
    """Every metric a logged from `from_step` on, equal in b (which logged nothing else). The accuracy counts
    margins > 0, which flips on rounding while the policy still equals the reference (margins ~1e-7):
    compared only between runs of one strategy."""
    keys = METRICS + ("eval_loss", "eval_rewards/margin") + (("eval_rewards/accuracy",) if accuracy else ())
    for key in keys:
        if key.endswith("accuracy") and not accuracy:
            continue
        la = {step: value for step, value in lines(a, key).items() if step >= from_step}
        lb = lines(b, key)
        assert sorted(la) == sorted(lb) and la, key
        assert lb == pytest.approx(la, rel=rel, abs=atol), key


def dpo_run(runs, model_dir, pairs, strategy, lora):
    """The uninterrupted DPO run of `strategy` ("single_gpu": one process, micro-batch 2), launched once per
    session: the equivalence tests and the uninterrupted half of the resume test read it (its checkpoints
    every 3 steps change nothing in what it trains; PADDING_FREE's full runs: padding-free pairs). (out dir,
    stdout)."""
    def make(folder):
        single = strategy == "single_gpu"
        packing = ["data.packing=true"] if strategy in PADDING_FREE and not lora else []
        proc = launch(strategy, recipe_for(folder, model_dir, pairs, "run", 2 if single else 1, lora,
                                           checkpoint_every=3, keep_last=4), nproc=1 if single else 2,
                      overrides=packing)
        assert_ok(proc)
        return folder / "run", proc.stdout
    return runs.get(f"dpo-{strategy}-{'lora' if lora else 'full'}", make)


def assert_matches_single(strategy, lora, ref, out):
    assert_same(ref, out, rel=1e-4, atol=1e-5, accuracy=False)
    wa, wb = weights(ref, lora), weights(out, lora)
    assert set(wa) == set(wb)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-4, rtol=1e-3, msg=f"{strategy}: {key}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_offload", "zero1", "zero2", "zero3", "zero3_offload"])
def test_full_dpo_matches_single_process(strategy, runs, tiny_model_dir, pairs):
    """Precomputed reference: one pass sharded across the ranks, gathered, then looked up per pair."""
    out, stdout = dpo_run(runs, tiny_model_dir, pairs, strategy, False)
    assert "reference log-probs of 64 pairs computed" in stdout  # 48 training + 16 eval pairs
    assert_matches_single(strategy, False, dpo_run(runs, tiny_model_dir, pairs, "single_gpu", False)[0], out)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_lora_dpo_matches_single_process(strategy, runs, tiny_model_dir, pairs):
    """Reference = the same wrapped model with the adapters disabled, under each strategy's wrapping."""
    out, _ = dpo_run(runs, tiny_model_dir, pairs, strategy, True)
    assert_matches_single(strategy, True, dpo_run(runs, tiny_model_dir, pairs, "single_gpu", True)[0], out)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_live_reference_model_gives_what_the_precomputed_pass_gives(strategy, runs, tmp_path, tiny_model_dir, pairs):
    """preference.reference: model -- a frozen copy sharded like the policy (FSDP2 units, a ZeRO-3 inference
    engine) scoring each micro-batch, on padding-free pairs -- trains the single-process precomputed run's model
    (padded)."""
    out = tmp_path / strategy
    recipe = recipe_for(tmp_path, tiny_model_dir, pairs, strategy, 1, False)
    proc = launch(strategy, recipe, overrides=["preference.reference=model", "data.packing=true"])
    assert_ok(proc)
    assert "reference log-probs" not in proc.stdout  # nothing precomputed
    single_full = dpo_run(runs, tiny_model_dir, pairs, "single_gpu", False)[0]
    assert_same(single_full, out, rel=1e-4, atol=1e-5, accuracy=False)
    wa, wb = weights(single_full, False), weights(out, False)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-4, rtol=1e-3, msg=f"{strategy}: {key}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_dpo_resumes_exactly_without_recomputing_the_reference(strategy, tmp_path, tiny_model_dir, pairs, runs):
    """A new launch given the uninterrupted run's step-6 checkpoint, in an output.dir holding the reference
    log-probs that run computed (where a stopped run leaves them), reads them instead of recomputing and
    repeats steps 7-10 exactly, evaluation included."""
    a, stdout = dpo_run(runs, tiny_model_dir, pairs, strategy, False)  # the uninterrupted run
    assert "computed with the initial weights" in stdout
    b = recipe_for(tmp_path, tiny_model_dir, pairs, "b", 1, False, checkpoint_every=3, keep_last=4)
    (tmp_path / "b").mkdir()
    shutil.copy(a / "reference_logps.safetensors", tmp_path / "b")
    second = launch(strategy, b, overrides=[f"output.resume={a / 'checkpoints' / 'step-00000006'}"])
    assert_ok(second)
    assert f"at step 6/{STEPS}" in second.stdout
    assert "reference log-probs read from" in second.stdout and "computed with the initial" not in second.stdout
    assert_same(a, tmp_path / "b", rel=1e-6, atol=1e-7, from_step=7)
    wa, wb = weights(a, False), weights(tmp_path / "b", False)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


def test_tiny_dpo_recipe_learns_the_preference(tmp_path, tiny_model_dir):
    """The shipped recipe as `make train-ddp` runs it: held-out reward accuracy above 0.9; every metric in
    metrics.jsonl and in TensorBoard."""
    import os
    import subprocess

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import free_port

    out = tmp_path / "run"
    args = f"model.name_or_path={tiny_model_dir} output.dir={out}"
    proc = subprocess.run(["make", "-s", "train-ddp", "GPUS=2", f"MASTER_PORT={free_port()}",
                           "RECIPE=recipes/tiny/dpo.yaml", f"ARGS={args}"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_ok(proc)
    evals = [r for r in read_metrics(out) if "eval_rewards/accuracy" in r]
    assert evals[-1]["eval_rewards/accuracy"] > 0.9, evals
    train_lines = [r for r in read_metrics(out) if "loss" in r]
    assert train_lines[0]["rewards/accuracy"] < 0.8  # it was learned, not given
    assert all(key in train_lines[-1] for key in METRICS + ("pairs",))
    events = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents*")).parent)).Reload()
    assert {"rewards/accuracy", "rewards/margin", "logps/chosen",
            "eval_rewards/accuracy"} <= set(events.Tags()["scalars"])
    assert (out / "final" / "model.safetensors").is_file()

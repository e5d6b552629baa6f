"""The compatibility matrix (disttrain/recipe/matrix.py) proven cell by cell.

- docs/compatibility.md is the declaration rendered (`make matrix`), byte for byte;
- every Refused cell is refused in one line by the checks train.py runs before the process group and before any
  weight loads (parallel/checks.check_before_launch with the column's plan; the model's config read, not its weights);
  every NeedsGpu cell is refused in one line without a GPU and let through with one; every Proven cell passes
  those checks (nothing claimed proven is refused);
- every Proven cell names tests that exist in the suite (collected by pytest itself), so CI runs them;
- the feature runs: for each config and kind, one launch with every feature its column proves by that kind
  (several at a time: pairwise coverage, one launch for many cells), against one process on the same recipe
  with the same 4 rows per optimizer step. `adapters`, `dora`, `full` and `preference`: losses, eval losses
  (per source), lm-eval scores and the end-of-run sample equal, weights to 1e-4 / 1e-3, as the strategy matrix
  (tests/strategy_runs.py). `noise` (LoRA dropout, NEFTune, bf16): replicas compared every step (a drift
  fails the run) and the losses within matrix.NOISE_TOLERANCE of one process's, whose draws are others. The
  one-process column's runs are the references: they are checked to run their features, not compared.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, held_out, launch, write_recipe
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.parallel.checks import check_before_launch
from disttrain.recipe import compat, matrix
from disttrain.recipe.matrix import COLUMNS, FEATURES, NeedsGpu, Proven, Refused
from disttrain.recipe.schema import load_recipe, recipe_to_dict
from disttrain.runtime.launcher import cpu_ring_env
from strategy_runs import final_weights

COLUMN = {c.config: c for c in COLUMNS}


def test_the_docs_table_is_the_declaration_rendered():
    assert (REPO / "docs" / "compatibility.md").read_text() == matrix.markdown(), "run `make matrix`"


def test_every_feature_has_exactly_one_cell_per_config():
    for feature in FEATURES:
        assert set(matrix.CELLS[feature.key]) == set(matrix.CONFIGS), feature.key
        for value in matrix.CELLS[feature.key].values():
            assert isinstance(value, (Proven, Refused, NeedsGpu))
            if isinstance(value, Proven):
                kinds = [t for t in value.tests if t.startswith("run:")]
                assert all(t[4:] in matrix.RUN_KINDS for t in kinds)


def test_the_features_of_one_run_never_set_the_same_field_two_ways():
    """A run proves each of its features only if none overrides another (DoRA would turn a LoRA run into a DoRA
    run, isolation a concat-and-chunk run into an isolated one)."""
    from disttrain.recipe.schema import parse_override

    for kind in matrix.RUN_KINDS:
        for config in matrix.CONFIGS:
            fields: dict[str, tuple[str, object]] = {}
            for feature in matrix.run_features(kind, config):
                for text in feature.overrides:
                    key, value = parse_override(text)
                    if key in fields and fields[key][1] != value:
                        pytest.fail(f"{kind} run under {config}: {feature.key} sets {key}={value!r}, "
                                    f"{fields[key][0]} sets {fields[key][1]!r}")
                    fields[key] = (feature.key, value)


# ------------------------------------------------------------------------------------------ the refusals
def plan_of(config: str):
    """The parallel plan of a launch of this column (parallel/plan.ParallelPlan, as its launch would read it)."""
    from disttrain.parallel.plan import ParallelPlan

    c = COLUMN[config]
    label = {"single_gpu": "single"}.get(config, config)
    return ParallelPlan(c.strategy, label, None, 2, None, c.sp, c.cp, c.tp, c.ep, c.fsdp_data, c.pp)


def checked(feature, config: str, gpu: bool, model_dir: Path, tmp_path: Path, monkeypatch) -> str | None:
    """The one-line refusal train.py gives this feature under this config before anything loads (None: none)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    monkeypatch.delenv(compat.ALLOW_UNVERIFIED, raising=False)
    # the CPU ring mapping stands in for the GPU kernels the ring maps on a GPU (the kernel check is its own test)
    monkeypatch.setitem(ring.custom_ops, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    recipe_file = write_recipe(tmp_path / "r.yaml", base_recipe(model_dir, tmp_path / "out"))
    recipe = load_recipe(recipe_file, list(feature.overrides))
    try:
        check_before_launch(recipe, plan_of(config), gpu)
    except DisttrainError as err:
        return str(err)
    return None


def model_for(feature, config, tiny_model_dir, tiny_moe_dir, tiny_vlm_dirs=None) -> Path:
    """The feature's model: its mixture-of-experts or vision-language model, else the tiny Llama; under expert
    parallelism, which splits experts, every text feature runs on the tiny Qwen3-MoE."""
    if feature.vision:
        return tiny_vlm_dirs["gemma3"]
    return tiny_moe_dir if feature.moe or COLUMN[config].ep > 1 else tiny_model_dir


CELLS = [(f, c) for f in FEATURES for c in matrix.CONFIGS]


@pytest.mark.parametrize("feature, config", [(f, c) for f, c in CELLS if isinstance(matrix.cell(f.key, c), Refused)],
                         ids=lambda x: getattr(x, "key", x))
def test_refused_cells_are_refused_in_one_line_before_anything_loads(feature, config, tiny_model_dir, tiny_moe_dir,
                                                                     tiny_vlm_dirs, tmp_path, monkeypatch):
    expected = matrix.cell(feature.key, config)
    model = model_for(feature, config, tiny_model_dir, tiny_moe_dir, tiny_vlm_dirs)
    said = checked(feature, config, expected.on_gpu, model, tmp_path, monkeypatch)
    assert said is not None, f"{feature.key} under {config} is declared refused but passes the checks"
    assert expected.says in said and "\n" not in said, said


@pytest.mark.parametrize("feature, config", [(f, c) for f, c in CELLS if isinstance(matrix.cell(f.key, c), NeedsGpu)],
                         ids=lambda x: getattr(x, "key", x))
def test_gpu_only_cells_are_refused_without_a_gpu_and_pass_with_one(feature, config, tiny_model_dir, tiny_moe_dir,
                                                                    tmp_path, monkeypatch):
    model = model_for(feature, config, tiny_model_dir, tiny_moe_dir)
    said = checked(feature, config, False, model, tmp_path, monkeypatch)
    assert said is not None and "GPU" in said and "\n" not in said, said
    assert checked(feature, config, True, model, tmp_path, monkeypatch) is None


@pytest.mark.parametrize("feature, config", [(f, c) for f, c in CELLS if isinstance(matrix.cell(f.key, c), Proven)],
                         ids=lambda x: getattr(x, "key", x))
def test_proven_cells_pass_the_checks(feature, config, tiny_model_dir, tiny_moe_dir, tiny_vlm_dirs, tmp_path,
                                     monkeypatch):
    model = model_for(feature, config, tiny_model_dir, tiny_moe_dir, tiny_vlm_dirs)
    said = checked(feature, config, False, model, tmp_path, monkeypatch)
    assert said is None, said


def test_every_proven_cell_names_tests_that_the_suite_collects():
    named = {t for f in FEATURES for c in matrix.CONFIGS if isinstance(v := matrix.cell(f.key, c), Proven)
             for t in v.tests if not t.startswith("run:")}
    files = sorted({t.split("::")[0] for t in named})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = set(proc.stdout.split())
    assert sorted(named - collected) == []


# ------------------------------------------------------------------------------------------ the feature runs
ROWS_PER_STEP = 4
STEPS = 4


def variant(kind: str, config: str) -> tuple[str, ...]:
    """What a kind's run under this config adds to its features (the reference runs the same): the preference
    loss in turn, the online-RL variant in turn."""
    if kind == "preference":
        loss = matrix.PREFERENCE_LOSS[config]
        return ("lora.r=8", "lora.dropout=0", f"preference.loss={loss}",
                *(("preference.reference=none",) if loss in ("simpo", "orpo") else ()))
    return {"rl": matrix.RL_VARIANT, "reward": matrix.REWARD_VARIANT, "vision": matrix.VISION_VARIANT,
            "distill": matrix.DISTILL_VARIANT}.get(kind, {}).get(config, ())


EVAL_ROWS = 8  # the held-out rows every run evaluates (the first of data/tiny_alpaca_eval.jsonl's 100): equal to
# one process on 8 rows proves what 100 would, at a twelfth of the forwards (at 16, evaluation took 18% of
# the time 8 sampled feature runs spent in train.py)


def eval_rows(folder: Path) -> Path:
    """The first EVAL_ROWS held-out rows, under the file's own name (the eval set's name in the logged keys)."""
    return held_out(folder, EVAL_ROWS)


def run_recipe(folder: Path, model_dir: Path, kind: str, features, data_ranks: int, name: str,
               extra: tuple[str, ...]) -> Path:
    """The tiny recipe with these features on, 4 rows per optimizer step over `data_ranks` (1: the reference); `extra`:
    the kind's variant. Online RL's micro-batches hold one prompt everywhere (bnpo normalises per micro-batch)."""
    micro, accum = {1: (2, 2), 2: (1, 2), 4: (1, 1)}[data_ranks]
    if kind == "rl":
        micro, accum = 1, 4 // data_ranks
    tree = base_recipe(model_dir, folder / name,
                       training={"max_steps": STEPS, "micro_batch_size": micro, "grad_accum": accum, "lr": 2e-3,
                                 "lr_scheduler": "cosine", "warmup_steps": 1, "max_grad_norm": 1.0},
                       data={"eval_path": str(eval_rows(folder))}, distributed={"check_replicas_every": 1})
    base = write_recipe(folder / f"{name}.base.yaml", tree)
    overrides = [o for f in features for o in f.overrides] + list(extra)
    recipe = load_recipe(base, overrides)
    recipe_dict = recipe_to_dict(recipe)
    recipe_dict["training"]["max_steps"] = STEPS // recipe.rl.num_iterations  # RL: batches of prompts
    return write_recipe(folder / f"{name}.yaml", recipe_dict)


def run_features(kind: str, config: str):
    return matrix.run_features(kind, config)


RUNS = [(config, kind) for kind in matrix.RUN_KINDS for config in matrix.CONFIGS if run_features(kind, config)]


def feature_run(runs, model_dir: Path, kind: str, config: str, features, extra: tuple[str, ...]) -> tuple[Path, str]:
    """The launch of `config` with `features` (one process for "single_gpu"; `extra`: the kind's variant), made
    once per session."""
    column = COLUMN[config]
    key = f"matrix-{kind}-{config}-{model_dir.name}-{'-'.join(f.key for f in features)}-{'-'.join(extra)}"
    if len(key) > 120 or "/" in key:  # a folder's name: a variant may name files (rl.rewards=[...])
        key = f"{key[:80].replace('/', '_')}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def make(folder: Path):
        recipe = run_recipe(folder, model_dir, kind, features, column.data_ranks, "run", extra)
        env = {**cpu_ring_env(), "OMP_NUM_THREADS": "1"} if column.cp > 1 else None
        proc = launch(config, recipe, nproc=column.processes, env=env)
        assert_ok(proc)
        return folder / "run", proc.stdout
    return runs.get(key, make)


def loaded_weights(out: Path, lora: bool) -> dict:
    """A vision-language export's weights as AutoModelForImageTextToText loads them (nothing missing or unexpected):
    the names a ZeRO-3 export writes differ from one process's (transformers' checkpoint mapping applied to the
    gathered names), the model they load is the same."""
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(out / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.state_dict()


COMPARED = ("loss", "eval_loss", "eval_nll", "reward", "reward_std", "kl", "entropy", "completions/mean_length",
            "clip_ratio/region_mean", "frac_reward_zero_std")
COMPARED_PREFIXES = ("eval_loss/", "lm_eval/", "rewards/", "eval_rewards/", "logps/", "dynamic_sampling/",
                     "starts_with_a_word/", "distill/")  # a reward function's log_metric, gathered over the ranks


def compared(out: Path) -> dict[tuple[int, str], float]:
    return {(r["step"], k): v for r in read_metrics(out) for k, v in r.items()
            if (k in COMPARED or k.startswith(COMPARED_PREFIXES)) and isinstance(v, (int, float))}


@pytest.mark.launch
@pytest.mark.parametrize("config, kind", RUNS, ids=[f"{c}-{k}" for c, k in RUNS])
def test_feature_run_trains_like_one_process(config, kind, runs, tiny_model_dir, tiny_moe_dir, tiny_vlm_dirs):
    features = run_features(kind, config)
    extra = variant(kind, config)
    model_dir = (tiny_vlm_dirs["gemma3"] if kind == "vision" else tiny_moe_dir if COLUMN[config].ep > 1
                 else tiny_model_dir)
    out, stdout = feature_run(runs, model_dir, kind, config, features, extra)
    ref, ref_stdout = feature_run(runs, model_dir, kind, "single_gpu", features, extra)
    keys = {f.key for f in features}
    ours, single = compared(out), compared(ref)
    assert sorted(s for s, k in ours if k == "loss") == list(range(1, STEPS + 1))
    if "eval_sets" in keys:
        assert any(k == "eval_loss" for _, k in ours) and any(k.startswith("eval_loss/") for _, k in ours)
    if "reward_model" in keys:  # trained and evaluated on pairs
        assert any(k == "rewards/accuracy" for _, k in ours) and any(k == "eval_rewards/accuracy" for _, k in ours)
    if "vlm" in keys:  # trained and evaluated on images, the chunked loss checked against the model's own
        assert any(k == "eval_loss" for _, k in ours)
    if "grpo" in keys:  # rolled out, scored by both functions, trained on
        assert {s for s, k in ours if k == "reward"} and any(k == "rewards/answer_words/mean" for _, k in ours)
        resampled = sum(v for (_, k), v in ours.items() if k == "dynamic_sampling/resampled_groups")
        assert (resampled > 0) == ("rl.dynamic_sampling=2" in extra), resampled  # groups without signal redrawn
        logged = any(k == "starts_with_a_word/share" for _, k in ours)  # TRL's log_metric, every rank's calls
        assert logged == any("starts_with_a_word" in e for e in extra)
    if "distill" in keys:  # the step's answers: sampled by the student (1), the teacher or the dataset (0), as drawn
        shares = {v for (_, k), v in ours.items() if k == "distill/on_policy"}
        lmbda = next(float(e.split("=")[1]) for e in (*matrix.FEATURE["distill"].overrides, *extra)[::-1]
                     if e.startswith("distill.lmbda="))
        assert shares == ({1.0} if lmbda == 1 else {0.0} if lmbda == 0 else {0.0, 1.0}), shares
        assert any(k == "eval_nll" for _, k in ours)
    if "scoring" in keys:
        assert {s for s, k in ours if k.startswith("lm_eval/")} == {STEPS}  # the last checkpoint, scored
    if "time_checkpoints" in keys:  # the clock is due at every step: every rank saved every step, completely
        saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
        assert saved == [f"step-{s:08d}" for s in range(1, STEPS + 1)], saved
        assert all((out / "checkpoints" / name / "manifest.json").is_file() for name in saved)
    if config == "single_gpu":  # the reference itself: its features ran (above); nothing to compare it with
        return
    assert set(ours) == set(single)
    lora = any("lora.r=8" in f.overrides for f in features) or "lora.r=8" in extra  # the adapter is exported
    if kind == "noise":  # other random draws than one process's: the statistics, not the values
        for key, value in single.items():
            assert abs(ours[key] - value) <= matrix.NOISE_TOLERANCE * abs(value), (key, ours[key], value)
        return
    # abs: rewards of a policy still equal to its reference are rounding noise around 0 (~1e-8)
    assert ours == pytest.approx(single, rel=1e-4, abs=1e-6), "\n".join(
        f"{k}: {ours[k]} vs {single[k]}" for k in sorted(single)
        if ours[k] != pytest.approx(single[k], rel=1e-4, abs=1e-6))
    if "samples" in keys:
        samples = [[line for line in text.splitlines() if line.startswith("sample: ")] for text in (stdout, ref_stdout)]
        assert samples[0] and samples[0] == samples[1]
        # sharded (not over a tp or ep mesh, whose every forward is collective): gathered whole once, not per token
        if config.startswith(("fsdp", "hsdp", "zero3")) and COLUMN[config].tp == COLUMN[config].ep == 1:
            assert "samples: the whole model gathered once for each evaluation's samples" in stdout
    weights = [(loaded_weights if kind == "vision" and not lora else final_weights)(run, lora) for run in (out, ref)]
    assert set(weights[0]) == set(weights[1]) and all(v.numel() > 0 for v in weights[0].values())
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[0][name], value, atol=1e-4, rtol=1e-3, msg=f"{config} {kind}: {name}")



@pytest.mark.launch
def test_a_vision_language_run_resumes_exactly(runs, tiny_vlm_dirs, tmp_path):
    """FSDP2, images: stopped after step 2 and launched again, it logs steps 3-4 equal to the uninterrupted run's
    (the matrix's fsdp run) and ends with its weights."""
    from strategy_runs import losses

    features, extra = run_features("vision", "fsdp"), variant("vision", "fsdp")
    whole, _ = feature_run(runs, tiny_vlm_dirs["gemma3"], "vision", "fsdp", features, extra)
    recipe = run_recipe(tmp_path, tiny_vlm_dirs["gemma3"], "vision", features, 2, "resumed", extra)
    assert_ok(launch("fsdp", recipe, nproc=2, overrides=["training.stop_at_step=2"]))
    assert_ok(launch("fsdp", recipe, nproc=2))
    resumed = tmp_path / "resumed"
    assert sorted(losses(resumed)) == list(range(1, STEPS + 1))
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-6, abs=1e-7)
    ours, theirs = loaded_weights(resumed, False), loaded_weights(whole, False)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-6, atol=1e-7, msg=name)

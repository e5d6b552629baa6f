"""The strategy matrix's runs: one per (strategy, full|LoRA), made once per test session (conftest.SharedRuns)
and read by every claim it can prove: equal to one process (test_strategies), the uninterrupted run that a
resumed run must repeat exactly (test_strategies, test_resume: kill during a save, corrupt checkpoints,
another world size).

Recipe: 35 alpaca rows, max_seq_len 48, 10 optimizer steps of 4 rows (cosine schedule after 2 warmup steps,
gradient clipping), checkpoints at steps 5 and 10 (both kept). A strategy's run: 2 processes x micro-batch 1
x accumulation 2; the reference: 1 process x micro-batch 2 x accumulation 2. Both see the same 4 rows per
optimizer step (one seeded permutation; accelerate deals rows to the ranks in turn) and the loss is
token-normalised over the whole step, so in fp32 they differ only by summation order. 8 steps per epoch
(3 rows dropped): step 5 is mid-epoch with accumulation, and the runs cross into the second, reshuffled
epoch at step 9.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics
from disttrain.runtime.launcher import free_port

STEPS, CHECKPOINT_EVERY = 10, 5
# merged on export too: every strategy's adapter merges into the base (test_launch_ddp reads the DDP one)
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "merge_on_export": True}
STRATEGIES = ["ddp", "fsdp", "fsdp_offload", "zero1", "zero2", "zero3", "zero3_offload"]
# the one run that also generates its end-of-run sample (greedy, every rank in step under ZeRO-3's gathered
# weights: test_strategies asserts it); the others skip it (tests/conftest.base_recipe)
SAMPLED = {"zero3": {"samples": 1, "sample_tokens": 8}}  # 8 greedy tokens: a forward each
# the one run that scores its checkpoints with lm-eval while training (evaluation: section; test_evaluation reads
# the numbers, test_strategies proves that the run still equals one process: the scoring leaves training alone)
EVAL_TASK, EVAL_LIMIT = "disttrain_tiny_choice", 10
# ZeRO-3's reader uses no collectives; FSDP2's DCP reader planned collectively on the default group and hung the
# run (the main process reads while the others wait): scored under both
EVALUATED = {(strategy, False): {"tasks": [EVAL_TASK], "every_steps": CHECKPOINT_EVERY, "limit": EVAL_LIMIT}
             for strategy in ("zero3", "fsdp")}


@dataclass(frozen=True)
class Run:
    out: Path  # the run's output.dir
    stdout: str


def small_data(runs) -> Path:
    """35 rows of the tiny alpaca set, one file for every test process."""
    def make(folder: Path) -> Path:
        path = folder / "small.jsonl"
        path.write_text("".join((REPO / "data/tiny_alpaca.jsonl").read_text().splitlines(keepends=True)[:35]))
        return path
    return runs.get("small-data", make)


def matrix_recipe(folder: Path, model_dir: Path, data: Path | dict, name: str, processes: int = 2,
                  lora: bool | dict = False, **sections) -> Path:
    """The matrix recipe written to folder/<name>.yaml, output.dir folder/<name>; `processes` sets the
    micro-batch that keeps 4 rows per optimizer step (1 process: 2 rows, 2 processes: 1 row; x accum 2).
    `data`: the file, or a whole data section; `lora`: True, or fields that replace LORA's; `sections`: fields
    merged into the recipe's sections."""
    tree = base_recipe(model_dir, folder / name, data={"path": str(data), "max_seq_len": 48},
                       training={"max_steps": STEPS, "micro_batch_size": 2 // processes, "grad_accum": 2,
                                 "lr": 2e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "max_grad_norm": 1.0},
                       # replicas compared every step (DDP, ZeRO-1/2): test_guards reads the DDP LoRA run as the
                       # control that correctly seeded ranks agree
                       distributed={"check_replicas_every": 1},
                       output={"checkpoint_every": CHECKPOINT_EVERY})
    if isinstance(data, dict):
        tree["data"] = data
    if lora:
        tree["lora"] = dict(LORA, **lora) if isinstance(lora, dict) else dict(LORA)
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return write_recipe(folder / f"{name}.yaml", tree)


def strategy_run(runs, model_dir: Path, strategy: str, lora: bool) -> Run:
    """The uninterrupted run of `strategy` ("single_gpu": the one-process reference), launched once."""
    def make(folder: Path) -> Run:
        processes = 1 if strategy == "single_gpu" else 2
        scored = EVALUATED.get((strategy, lora), {})
        recipe = matrix_recipe(folder, model_dir, small_data(runs), "run", processes, lora,
                               logging=SAMPLED.get(strategy, {}), evaluation=scored,
                               # a scoring that hangs the other ranks fails in minutes, not at the 30-min default
                               distributed={"timeout_s": 300} if scored else {})
        proc = launch(strategy, recipe, nproc=processes)
        assert_ok(proc)
        return Run(folder / "run", proc.stdout)
    return runs.get(f"{strategy}-{'lora' if lora else 'full'}", make)


def make_train(target: str, recipe: Path, *variables: str, env: dict | None = None) -> str:
    """`make -s <target> VARIABLE=... RECIPE=<recipe>` as a user types it, on a free rendezvous port: its stdout,
    the run checked to have succeeded."""
    proc = subprocess.run(["make", "-s", target, *variables, f"MASTER_PORT={free_port()}", f"RECIPE={recipe}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert_ok(proc)
    return proc.stdout


def warm_like_make(config: str, recipe: Path, processes: int, *overrides: str, **variables) -> str:
    """What `make train-<config> GPUS=<processes> VARIABLE=...` launches, through the suite's warm launcher: the
    mesh flags `make mesh-flags` prints for it (fsdp_ep's expert size from the environment, as the Makefile's
    MESH_ENV). Every config still runs through `make train-*` in one of its tests (test_real_launcher.py lists
    them); its other runs take this road, which spares each process the libraries' imports."""
    settings = [f"{name}={value}" for name, value in variables.items()]
    flags = subprocess.run(["make", "-s", "mesh-flags", f"STRATEGY={config}", f"GPUS={processes}", *settings],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    env = {"PARALLELISM_CONFIG_EP_SIZE": str(variables["EP"])} if config == "fsdp_ep" else None
    proc = launch(config, recipe, nproc=processes, overrides=overrides, extra_args=flags, env=env)
    assert_ok(proc)
    return proc.stdout


def losses(out: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


def grad_norms(out: Path) -> dict:
    return {r["step"]: r["grad_norm"] for r in read_metrics(out) if "grad_norm" in r}


def final_weights(out: Path, lora: bool) -> dict:
    return load_file(out / "final" / ("adapter_model.safetensors" if lora else "model.safetensors"))


def assert_same_run(a: Path, b: Path, lora: bool, steps: int = STEPS, first_step: int = 1) -> None:
    """b (resumed, or killed and relaunched) logged steps first_step..steps once each, equal to the
    uninterrupted a's, and ended with its weights (1e-6: the same computation in the same order)."""
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(first_step, steps + 1)), "one line per step, no gap, no duplicate"
    assert lb == pytest.approx({s: la[s] for s in lb}, rel=1e-6, abs=1e-7)
    wa, wb = final_weights(a, lora), final_weights(b, lora)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


def assert_trains_like_one_process(out: Path, ref: Path, lora: bool) -> None:
    """A sequence mesh's run (one group reading the one-process batch) against the one-process reference: each
    step logged once, losses 1e-4, exported weights (none empty) 1e-4/1e-3, as every strategy of the matrix."""
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert losses(out) == pytest.approx(losses(ref), rel=1e-4)
    ours, single = final_weights(out, lora), final_weights(ref, lora)
    assert set(ours) == set(single) and all(v.abs().sum() > 0 for v in ours.values())
    for key, value in single.items():
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-3, msg=key)


def assert_resumes_on_its_mesh(runs, model_dir: Path, out: Path, config: str, folder: Path, env=None,
                               nproc: int = 2, data_ranks: int = 1, lora: bool = False) -> None:
    """A mesh's run (`data_ranks` groups of processes reading the one-process batch between them): a new launch
    of `nproc` processes under `config` from its step-5 checkpoint repeats steps 6-10 and the weights of the
    uninterrupted `out` (assert_same_run)."""
    from conftest import launch

    checkpoint = out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    recipe = matrix_recipe(folder, model_dir, small_data(runs), "resumed", processes=data_ranks, lora=lora)
    proc = launch(config, recipe, nproc=nproc, overrides=[f"output.resume={checkpoint}"], env=env)
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step {CHECKPOINT_EVERY}/{STEPS}" in proc.stdout
    assert_same_run(out, folder / "resumed", lora=lora, first_step=CHECKPOINT_EVERY + 1)


def assert_exports_from_its_last_checkpoint(out: Path, folder: Path) -> None:
    """`make export` (disttrain.model.from_checkpoint, one process) reads the run's step-10 checkpoint back as
    exactly the model the run exported."""
    import sys

    last = out / "checkpoints" / f"step-{STEPS:08d}"
    proc = subprocess.run([sys.executable, "-m", "disttrain.model.from_checkpoint", str(last),
                           str(folder / "exported")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_ok(proc)
    exported, final = (load_file(d / "model.safetensors") for d in (folder / "exported", out / "final"))
    assert set(exported) == set(final)
    for key, value in final.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


def assert_preflight_trains_like(recipe: str, strategy: str, folder: Path, reference: str = "single_gpu",
                                 nproc: int = 1, micro_batch_factor: int = 1) -> None:
    """`make preflight STRATEGY=<strategy>` of a shipped recipe passes every stage (trains, checkpoints, resumes
    in a new launch at step 2, exports); then the run's own recipe copy (the shrunk model, the same rows) under
    `reference` on `nproc` processes, each micro-batch `micro_batch_factor` times the preflight's, logs the same
    4 losses (rel 1e-4) and ends with the same weights (1e-4 / 1e-3; a LoRA recipe's: its adapters)."""
    import yaml

    from disttrain.tools.preflight import run

    work = folder / "pf"
    report = run(str(REPO / "recipes" / recipe), strategy, nproc=None, steps=4, work_dir=work,
                 overrides=["logging.samples=0", "output.report=false"])
    assert [(stage, status) for stage, status, _ in report.rows] == [
        (stage, "PASS") for stage in ("recipe", "compatibility", "shrink", "save", "resume", "export")], report.rows
    micro_batch = yaml.safe_load((work / "run" / "recipe.yaml").read_text())["training"]["micro_batch_size"]
    other = launch(reference, work / "run" / "recipe.yaml", nproc=nproc,
                   overrides=[f"output.dir={folder / 'other'}", "output.resume=none", "training.stop_at_step=null",
                              f"training.micro_batch_size={micro_batch * micro_batch_factor}"])
    assert_ok(other)
    losses = [{r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
              for out in (work / "run", folder / "other")]
    assert sorted(losses[0]) == [1, 2, 3, 4] and losses[0] == pytest.approx(losses[1], rel=1e-4)
    lora = (work / "run" / "final" / "adapter_model.safetensors").is_file()
    ours, theirs = (final_weights(out, lora) for out in (work / "run", folder / "other"))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-3, msg=key)


def mesh_plan(monkeypatch, processes: int, **sizes):
    """The ParallelPlan of a launch of `processes` whose accelerate config set these mesh sizes."""
    from disttrain.parallel.plan import ParallelPlan

    monkeypatch.setenv("WORLD_SIZE", str(processes))
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for dim, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", str(size))
    return ParallelPlan.from_launch()

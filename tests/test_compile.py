"""training.compile: regional torch.compile (accelerate's TorchDynamoPlugin) trains exactly like eager, and
compiles once: no recompilation while training on batches of varying sequence lengths."""

from __future__ import annotations

import re

import pytest

from conftest import assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics


def _run(folder, config: str, compiled: bool, model_dir):
    """3 steps of the base recipe, 4 rows a step, compiled or not: (out dir, the launch)."""
    processes = 1 if config == "single_gpu" else 2
    out = folder / f"compile-{compiled}"
    # no samples: generating with a KV cache compiles inference graphs of its own (not what is checked)
    recipe = write_recipe(folder / f"{compiled}.yaml", base_recipe(
        model_dir, out, training={"max_steps": 3, "compile": compiled, "micro_batch_size": 4 // processes},
        logging={"samples": 0}, output={"checkpoint_at_end": False}))
    proc = launch(config, recipe, nproc=processes, timeout=900, env={"TORCH_LOGS": "recompiles"})
    assert_ok(proc)
    assert f"compile={'regional' if compiled else 'no'}" in proc.stdout
    return out, proc


@pytest.mark.launch
@pytest.mark.parametrize("config", ["single_gpu", "ddp", "fsdp"])  # the configs compat lets it run under
def test_compiled_run_matches_eager_losses_without_recompiles(config, tmp_path, runs, tiny_model_dir):
    """Under DDP the compiled model once crashed the start-up (accelerate's unwrap_model kept the compiled copy of
    the DDP module, which has no config: the FLOPs meter, the export and NEFTune need the bare model). The eager
    reference is one process's, launched once: every strategy trains it (tests/test_strategies.py)."""
    processes = 1 if config == "single_gpu" else 2
    eager = runs.get("compile-eager", lambda folder: _run(folder, "single_gpu", False, tiny_model_dir)[0])
    out, proc = _run(tmp_path, config, True, tiny_model_dir)
    # each training step has another sequence length: with dynamic shapes nothing recompiles (lm_head's
    # chunked loss once recompiled for every length until Dynamo's limit, then ran eagerly)
    # (2 processes: micro-batches of 2, some with no padding, for which the model passes no attention mask;
    # that is one more graph per block, compiled once, whatever the lengths)
    logged = [line.split("[__recompiles]")[1].strip() for line in proc.stderr.splitlines()
              if "[__recompiles]" in line]
    reasons = [line for line in logged if re.match(r"- \d+/\d+: ", line)]  # "- 2/0: <the guard that failed>"
    assert all("attention_mask" in reason for reason in reasons), reasons[:3]
    assert len(reasons) <= 2 * processes, reasons  # at most once per compiled function and process
    assert (out / "final" / "model.safetensors").is_file()  # exported from the bare model
    losses = {run: [r["loss"] for r in read_metrics(run) if "loss" in r] for run in (eager, out)}
    assert len(losses[out]) == 3 and losses[out] == pytest.approx(losses[eager], rel=1e-4)

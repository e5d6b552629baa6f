"""The real launcher, not only the warm one (tests/warm): every shipped accelerate config runs train.py at least
once through `accelerate launch` / `make train-*` as a user types it. The configs the rest of the suite launches
only warm (`make train`'s single process, fsdp_offload, zero1, zero2, zero3_offload) run the strategy matrix's
recipe here and log the losses of the matrix's warm run of the same config, step for step (the other configs go
through `make train-*` in test_hsdp, test_ulysses, test_context_parallel, test_tensor_parallel, test_fsdp_tp,
test_expert_parallel, test_pipeline, and
DDP, FSDP2 and ZeRO-3 below). An error raised after the process group exists (the loss self-check failing on
purpose: tests/scripts/faulty_train.py) leaves a real interpreter's launch promptly, with its one line, under
DDP, FSDP2 and ZeRO-3: the warm workers always leave through os._exit, so only this shows the teardown."""

import pytest

from conftest import REPO, launch_command, real_launcher
from strategy_runs import STEPS, losses, make_train, matrix_recipe, small_data, strategy_run

pytestmark = pytest.mark.launch

# config -> the make target that launches it (`make train`: the single-process config)
WARM_ONLY = {"single_gpu": "train", "fsdp_offload": "train-fsdp-offload", "zero1": "train-zero1",
             "zero2": "train-zero2", "zero3_offload": "train-zero3-offload"}


@pytest.mark.parametrize("config", list(WARM_ONLY))
def test_the_real_launcher_trains_as_the_warm_one(config, runs, tiny_model_dir, tmp_path):
    processes = 1 if config == "single_gpu" else 2
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "run", processes)
    stdout = make_train(WARM_ONLY[config], recipe, "GPUS=2")
    assert f"processes={processes}" in stdout
    warm = strategy_run(runs, tiny_model_dir, config, False).out
    ours = losses(tmp_path / "run")
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert ours == pytest.approx(losses(warm), rel=1e-6)


@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_an_error_after_the_process_group_exists_leaves_the_real_launcher_in_one_line(config, tiny_model_dir,
                                                                                      tmp_path):
    import os
    import subprocess

    from conftest import base_recipe, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out",
                                                           distributed={"timeout_s": 60}))
    cmd = real_launcher(launch_command(config, 2, "tests/scripts/faulty_train.py", "--recipe", str(recipe)))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DISTTRAIN_TEST_FAULT": "self_check"})
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert errors and all("training.loss_impl=chunked: on the first micro-batch" in e for e in errors), errors
    assert 'File "' + str(REPO / "train.py") not in proc.stderr  # no traceback of a worker's
    assert "timed out" not in proc.stderr and "SIGABRT" not in proc.stderr

"""Checkpoint bookkeeping without processes: which checkpoints pruning keeps, and which directory a new run
refuses. (Saving and resuming real states under every strategy: tests/test_resume.py.)"""

import os
from pathlib import Path

import pytest

from disttrain.training import checkpoint
from disttrain.training.checkpoint import CheckpointError, Checkpointer, RunShape
from disttrain.training.loop import TrainState


class OneProcess:
    """The accelerator calls checkpoint.save makes, for a single process writing one file of state."""

    is_main_process = True

    def wait_for_everyone(self):
        pass

    def save_state(self, directory: str):
        (Path(directory) / "model.safetensors").write_bytes(b"weights")

    def print(self, *args):
        pass


def save_at(out: Path, steps, keep_last=2) -> Checkpointer:
    saver = Checkpointer(OneProcess(), out, every=1, at_end=True, keep_last=keep_last, shape=RunShape(1, "ddp", 1, 1))
    for step in steps:
        saver.save(TrainState(step=step))
    return saver


def names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_keep_last_keeps_the_newest_saves(tmp_path):
    save_at(tmp_path, [1, 2, 3, 4])
    assert names(tmp_path) == ["latest", "step-00000003", "step-00000004"]


def test_a_run_resumed_from_an_older_checkpoint_never_prunes_what_it_just_wrote(tmp_path):
    """Resumed from step 3 while steps 10 and 20 of the abandoned continuation are still there: the new
    step-6 and step-9 checkpoints are kept (pruning by step number deleted them) and `latest` names them."""
    save_at(tmp_path, [3, 10, 20], keep_last=3)
    save_at(tmp_path, [6], keep_last=2)
    assert names(tmp_path) == ["latest", "step-00000006", "step-00000020"]
    assert checkpoint.find(tmp_path, "auto").name == "step-00000006"
    save_at(tmp_path, [9], keep_last=2)
    assert names(tmp_path) == ["latest", "step-00000006", "step-00000009"]
    assert checkpoint.find(tmp_path, "auto").name == "step-00000009"


def test_keep_last_one_keeps_only_the_checkpoint_just_written(tmp_path):
    save_at(tmp_path, [5, 8])
    save_at(tmp_path, [2], keep_last=1)
    assert names(tmp_path) == ["latest", "step-00000002"]


def test_a_new_run_refuses_a_directory_holding_another_runs_checkpoints(tmp_path):
    checkpoint.check_fresh_start(tmp_path, "none")  # nothing there: fine
    save_at(tmp_path, [4])
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_fresh_start(tmp_path, "none")
    message = str(error.value)
    assert "step-00000004" in message and "output.resume=auto" in message and "new output.dir" in message
    checkpoint.check_fresh_start(tmp_path, "auto")  # resuming it is what auto does


def test_the_save_order_does_not_leak_into_the_resumed_train_state(tmp_path):
    saver = save_at(tmp_path, [4])
    state = checkpoint.check_shape(saver.last_saved, RunShape(1, "ddp", 1, 1))
    assert state == {"step": 4, "epoch": 0, "tokens_seen": 0}


def test_another_strategys_checkpoint_names_both_ways_out(tmp_path):
    """`make train-ddp` then `make train-fsdp` with the same recipe: the refusal says how to go on."""
    saver = save_at(tmp_path / "run", [3])
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_shape(saver.last_saved, RunShape(2, "fsdp", 1, 1))
    message = str(error.value)
    assert "written under ddp, this run is fsdp" in message
    assert "its own accelerate config (ddp)" in message and f"output.dir={tmp_path / 'run'}-fsdp" in message


@pytest.mark.parametrize("config, label, stage", [
    ("zero1", "zero1", 1), ("zero2", "zero2", 2), ("zero3", "zero3", 3), ("zero3_offload", "zero3_offload", 3),
    ("fsdp", "fsdp", None), ("fsdp_offload", "fsdp_offload", None), ("ddp", "ddp", None)])
def test_strategy_names_the_zero_stage_and_offload_as_the_config_files_do(config, label, stage, monkeypatch):
    """{strategy} was `zero` for every ZeRO stage (the stage lives in the DeepSpeed JSON, not in the variable
    read), so `make train-zero2` then `make train-zero3` shared a directory. The environment is the one
    `accelerate launch` builds from the shipped config file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from disttrain.runtime import backends
    from disttrain.runtime.launcher import REPO as ROOT

    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)
    args = launch_command_parser().parse_args(["--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
                                               "--num_processes", "2", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    env = prepare_deepspeed_cmd_env(args)[1] if args.use_deepspeed else prepare_multi_gpu_env(args)
    monkeypatch.chdir(ROOT)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert backends.run_label() == label and backends.zero_stage() == stage


def test_a_zero2_checkpoint_is_refused_by_zero3_in_one_line(tmp_path):
    saver = Checkpointer(OneProcess(), tmp_path / "run", every=1, at_end=True, keep_last=2,
                         shape=RunShape(2, "deepspeed", 1, 1, zero_stage=2))
    saver.save(TrainState(step=3))
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_shape(saver.last_saved, RunShape(2, "deepspeed", 1, 1, zero_stage=3))
    message = str(error.value)
    assert "written under ZeRO-2, this run is ZeRO-3" in message and "accelerate_configs/zero2.yaml" in message
    assert f"output.dir={tmp_path / 'run'}-zero3" in message and "\n" not in message
    checkpoint.check_shape(saver.last_saved, RunShape(2, "deepspeed", 1, 1, zero_stage=2))  # the same stage: fine
    checkpoint.check_shape(saver.last_saved, RunShape(2, "deepspeed", 1, 1))  # older checkpoints carry no stage


class FullDisk(OneProcess):
    """save_state fails the way a full disk makes it fail: ENOSPC, or torch's C++ writer with no errno."""

    def __init__(self, error):
        self.error = error

    def save_state(self, directory: str):
        (Path(directory) / "model.safetensors").write_bytes(b"half a shard")
        raise self.error


@pytest.mark.parametrize("error, free", [
    (OSError(28, "No space left on device"), 10 * 2**30),
    (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"), 0),
    (RuntimeError("basic_ios::clear: iostream error"), 0)])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays_the_one_to_resume(error, free, tmp_path,
                                                                                      monkeypatch):
    saver = save_at(tmp_path, [2])
    full = Checkpointer(FullDisk(error), tmp_path, every=1, at_end=True, keep_last=2, shape=RunShape(1, "ddp", 1, 1))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: type("Usage", (), {"free": free})())
    with pytest.raises(CheckpointError) as raised:
        full.save(TrainState(step=4))
    message = str(raised.value)
    assert message.startswith(f"no space left on {tmp_path / 'checkpoints'} while writing the checkpoint of step 4: "
                              "step-00000002 is intact and a rerun resumes from it") and "output.keep_last" in message
    assert names(tmp_path) == ["latest", "step-00000002"]  # the partial save removed, nothing else touched
    assert checkpoint.find(tmp_path, "auto") == saver.last_saved
    with pytest.raises(RuntimeError, match="an unrelated failure"):  # other failures are not disguised
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 10 * 2**30})())
        Checkpointer(FullDisk(RuntimeError("an unrelated failure")), tmp_path, every=1, at_end=True, keep_last=2,
                     shape=RunShape(1, "ddp", 1, 1)).save(TrainState(step=6))


def test_a_disk_smaller_than_a_checkpoint_is_said_before_the_first_save(tmp_path, monkeypatch):
    import torch

    printed = []
    accelerator = OneProcess()
    accelerator.print = lambda *args: printed.append(" ".join(map(str, args)))
    model = torch.nn.Linear(1000, 1000)  # 1M weights: ~4 MB + 12 MB of Adam moments
    expected = checkpoint.expected_bytes(model)
    assert expected == 1_001_000 * (4 + 8)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 2**20})())
    Checkpointer(accelerator, tmp_path / "run", every=10, at_end=True, keep_last=2, shape=RunShape(1, "ddp", 1, 1),
                 expected_bytes=expected)
    assert len(printed) == 1 and printed[0].startswith("WARNING: checkpoint: 1.0 MiB free on the disk of")


def test_time_cadence_counts_from_the_start_and_from_each_save(tmp_path):
    now = [100.0]
    saver = Checkpointer(OneProcess(), tmp_path / "run", every=None, at_end=True, keep_last=2,
                         shape=RunShape(1, "ddp", 1, 1), minutes=30, clock=lambda: now[0])
    now[0] += 30 * 60 - 1
    assert not saver.time_due()
    now[0] += 1
    assert saver.time_due() and not saver.due(7, last=False)  # the step cadence is off: time alone says so
    saver.save(TrainState(step=7))
    assert not saver.time_due()  # the clock restarts at a save
    now[0] += 30 * 60
    assert saver.time_due()
    off = Checkpointer(OneProcess(), tmp_path / "off", every=None, at_end=True, keep_last=2,
                       shape=RunShape(1, "ddp", 1, 1), minutes=None, clock=lambda: now[0])
    now[0] += 10**6
    assert not off.time_due()


def test_any_rank_clock_makes_every_rank_save():
    """Each rank's flags go into the step's one all-reduce: one rank's clock saying a save is due (or one rank
    seeing SIGTERM) sets the flag for all, so no rank waits in a collective save the others skip."""
    import torch

    from disttrain.training import loop

    class TwoRanks:  # this rank raised nothing; the other rank raised the time flag
        device, num_processes, gradient_accumulation_steps = torch.device("cpu"), 2, 1

        def reduce(self, tensor, reduction):
            other = torch.zeros_like(tensor)
            other[0], other[1 + loop.TIME_DUE] = 5.0, 1.0
            return tensor + other

    class Units:
        def units(self, batch):
            return torch.tensor(float(batch["n"]))

    denominator, flags = loop._window_denominator([{"n": 3}], TwoRanks(), Units(), (False, False))
    assert float(denominator) == 4.0  # (3 + 5) target tokens / (2 ranks x 1 micro-batch)
    assert flags.is_set(loop.TIME_DUE) and not flags.is_set(loop.STOP)

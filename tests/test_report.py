"""What a finished run leaves: a model card in the Hub's format, plots that open, `make report` for one or
several runs; and trying strategies one after another with the defaults (no collision, a finished run says so)."""

import json
import os
import subprocess

import pytest

from disttrain.errors import DisttrainError
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, assert_ok, base_recipe, held_out, free_port, launch, write_recipe
from disttrain.metrics.log import read_metrics
from disttrain.report import summary_row, summary_table, write_report
from disttrain.training.samples import sample_prompts


def fake_run(run, lora=False, final=True):
    """A run dir as train.py leaves it: recipe.yaml, run.json, data_report.json, metrics.jsonl (with a resume)."""
    run.mkdir(parents=True)
    recipe = {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"},
              "data": {"path": "yahma/alpaca-cleaned", "format": "alpaca", "max_seq_len": 512},
              "training": {"objective": "sft", "lr": 2e-5}, "lora": {"r": 8} if lora else None,
              "output": {"dir": str(run)}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (run / "run.json").write_text(json.dumps({"strategy": "fsdp", "processes": 8, "device": "cuda",
                                              "device_name": "NVIDIA H100", "mixed_precision": "bf16",
                                              "global_batch": 64, "total_steps": 20}))
    (run / "data_report.json").write_text(json.dumps({"train": {"examples": 1000, "rows": 990, "target_tokens": 5e4,
                                                                "tokens": 2e5}}))
    lines = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_s_per_device": 1000.0 + s,
              "mfu": 0.4, **({"resumed_from_step": 10} if s == 11 else {})} for s in range(1, 21)]
    lines += [{"step": 10, "eval_loss": 2.5}, {"step": 20, "eval_loss": 1.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if final:
        (run / "final").mkdir()
    return run


@pytest.mark.parametrize("lora", [False, True])
def test_model_card_and_plots_of_a_run(tmp_path, lora):
    from huggingface_hub import ModelCard
    from matplotlib.image import imread

    run = fake_run(tmp_path / "run", lora)
    written = write_report(run)
    assert {p.name for p in written} >= {"loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "mfu.png",
                                         "overview.png", "README.md"}
    for png in (p for p in written if p.suffix == ".png"):
        assert imread(png).shape[0] > 100  # a real image that opens
    card = ModelCard.load(run / "final" / "README.md")
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and card.data.datasets == ["yahma/alpaca-cleaned"]
    assert card.data.library_name == ("peft" if lora else "transformers") and card.data.license == "other"
    assert {"disttrain", "sft", "fsdp"} <= set(card.data.tags)
    text = card.text
    assert "fsdp, 8 process(es) on cuda (NVIDIA H100)" in text and "| final eval loss | 1.5 |" in text
    assert ("AutoPeftModelForCausalLM" if lora else "AutoModelForCausalLM") in text
    assert "1000 examples -> 990 rows" in text and "lr: 2.0e-05" in text  # the recipe itself


def test_the_card_and_plots_of_online_rl_and_reward_model_runs(tmp_path):
    """A GRPO run's card gives the reward at its first and last log line and its plots the reward, completion
    lengths, KL and entropy; a reward model's card loads it as a sequence classifier (a LoRA one with one label)."""
    from huggingface_hub import ModelCard

    grpo = fake_run(tmp_path / "grpo")
    recipe = yaml.safe_load((grpo / "recipe.yaml").read_text())
    recipe["training"]["objective"] = "grpo"
    (grpo / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with (grpo / "metrics.jsonl").open("a") as f:
        for s, reward in ((5, 0.1), (10, 0.25), (20, 0.4)):
            line = {"step": s, "loss": 0.0, "reward": reward, "reward_std": 0.2, "kl": 0.01 * s, "entropy": 2.0,
                    "completions/mean_length": 30.0, "completions/max_length": 64.0}
            f.write(json.dumps(line) + "\n")
    written = {p.name for p in write_report(grpo)}
    assert {"rl_reward.png", "rl_completions.png", "rl_kl_entropy.png"} <= written
    assert "| reward (first -> last log line) | 0.1 -> 0.4 |" in ModelCard.load(grpo / "final" / "README.md").text
    scorer = fake_run(tmp_path / "reward", lora=True)
    recipe = yaml.safe_load((scorer / "recipe.yaml").read_text())
    recipe["training"]["objective"] = "reward"
    (scorer / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    write_report(scorer)
    text = ModelCard.load(scorer / "final" / "README.md").text
    assert 'AutoPeftModelForSequenceClassification.from_pretrained("<this directory>", num_labels=1)' in text


def test_report_table_compares_runs_and_in_progress_runs_get_plots(tmp_path, capsys):
    from disttrain.report.__main__ import main

    done, running = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", final=False)
    main([str(done), str(running)])
    out = capsys.readouterr().out
    assert out.count("| fsdp | 8 | sft |") == 2 and "| 20 | 20 | 1 | 1.5 |" in out
    assert (running / "plots" / "overview.png").is_file() and not (running / "final" / "README.md").exists()
    row = summary_row(done)
    assert row["resumes"] == 1 and row["mfu"] == pytest.approx(0.4) and row["complete"]
    assert "| run |" in summary_table([row])


def test_a_glob_that_matches_a_dir_without_metrics_skips_it_and_reports_the_rest(tmp_path, capsys):
    """`make report RUN="outputs/tiny-sft/*"` matched a dir with no metrics.jsonl and aborted the whole report."""
    from disttrain.report.__main__ import main

    done, empty = fake_run(tmp_path / "a"), tmp_path / "b"
    empty.mkdir()
    main([str(done), str(empty)])
    out = capsys.readouterr().out
    assert f"skipped {empty}: no metrics.jsonl" in out and "| fsdp | 8 | sft |" in out
    with pytest.raises(DisttrainError, match="no metrics.jsonl here"):
        main([str(empty)])


def test_sample_prompts_stop_where_the_targets_start():
    sft = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, -100, 4, 5]}
    pair = {"chosen_input_ids": [7, 8, 9], "chosen_labels": [-100, -100, 9], "rejected_input_ids": [7, 8, 6],
            "rejected_labels": [-100, -100, 6]}
    packed = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, 3, -100, -100, 6],
              "position_ids": [0, 1, 2, 0, 1, 2]}
    document = {"input_ids": list(range(40)), "labels": list(range(40))}
    assert sample_prompts([sft, pair, packed, document], 4) == [[1, 2, 3], [7, 8], [1, 2], list(range(16))]


@pytest.mark.launch
def test_strategies_one_after_another_with_the_defaults(tmp_path, tiny_model_dir):
    """`make train-ddp`, then `make train-fsdp` with the same recipe: each gets its own dir ({strategy}-
    {processes}), both finish with a model card and plots; the DDP run launched again says it is complete."""
    tree = base_recipe(tiny_model_dir, tmp_path / "runs" / "{strategy}-{processes}",
                       training={"max_steps": 4, "eval_every": 2}, logging={"report_to": ["tensorboard"], "samples": 2},
                       data={"eval_path": str(held_out(tmp_path))}, output={"report": True})
    recipe = write_recipe(tmp_path / "r.yaml", tree)

    def make(target):
        proc = subprocess.run(["make", "-s", target, "GPUS=2", f"MASTER_PORT={free_port()}", f"RECIPE={recipe}"],
                              cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert_ok(proc)
        return proc

    make("train-ddp")
    fsdp = make("train-fsdp")
    assert "was written under" not in fsdp.stdout + fsdp.stderr
    assert "sample: '<|im_start|>user" in fsdp.stdout  # generated with sharded weights, every rank in step
    for run in ("ddp-2", "fsdp-2"):
        out = tmp_path / "runs" / run
        assert (out / "final" / "README.md").is_file() and (out / "plots" / "overview.png").is_file()
        samples = [r for r in read_metrics(out) if "samples" in r]
        assert [r["step"] for r in samples] == [2, 4] and len(samples[0]["samples"]) == 2
        assert all(s["prompt"].endswith("assistant\n") for s in samples[0]["samples"])
        events = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents*")).parent)).Reload()
        assert "samples/text_summary" in events.Tags()["tensors"]
    again = launch("ddp", recipe)  # the same run again (train.py's own check; the warm launcher, as the matrix)
    assert_ok(again)
    assert "run complete:" in again.stdout and "final model:" not in again.stdout

"""`make eval` (disttrain/evaluation): lm-evaluation-harness on a run's exported model and its base, on the
project's own local task (eval_tasks/disttrain_tiny, over data/tiny_tasks_eval.jsonl). The numbers are lm-eval's:
`make eval` gives exactly what lm-eval's own command line gives on the same model, prompts and examples; a LoRA
run is evaluated as its adapter on the base, equal to its merged export; bad input is one line."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_ok, launch
from disttrain.errors import DisttrainError
from strategy_runs import CHECKPOINT_EVERY, EVAL_LIMIT, EVAL_TASK, EVALUATED, STEPS, final_weights, strategy_run

LIMIT = "20"
TASK = "disttrain_tiny_choice"


@pytest.mark.launch
def test_make_eval_equals_lm_evals_command_line_on_the_same_model(runs, tiny_model_dir, tmp_path):
    run = strategy_run(runs, tiny_model_dir, "ddp", False).out
    proc = subprocess.run(["make", "-s", "eval", f"RUN={run}", f"TASKS={TASK},disttrain_tiny_generate", "BASE=1",
                           f"LIMIT={LIMIT}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((run / "eval" / "results.json").read_text())
    ours = record["models"]["fine_tuned"]["results"]
    assert record["chat_template"] is True and record["limit"] == int(LIMIT)
    assert record["models"]["fine_tuned"]["model"] == str(run / "final")
    assert record["models"]["base"]["model"] == str(tiny_model_dir)  # the recipe's model.name_or_path
    assert 0 <= ours[TASK]["acc,none"] <= 1 and "exact_match,strip" in ours["disttrain_tiny_generate"]
    assert f"| {TASK} | acc |" in proc.stdout

    cli = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={run / 'final'},dtype=auto,tokenizer={run / 'final'}", "--include_path", "eval_tasks",
         "--tasks", TASK, "--apply_chat_template", "--limit", LIMIT, "--batch_size", "8", "--device", "cpu",
         "--output_path", str(tmp_path / "cli")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    (written,) = (tmp_path / "cli").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"][TASK]
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert ours[TASK][metric] == theirs[metric], metric


@pytest.mark.launch
def test_a_lora_run_is_evaluated_as_its_adapter_on_the_base_equal_to_its_merged_export(runs, tiny_model_dir):
    from disttrain.evaluation.__main__ import main

    run = strategy_run(runs, tiny_model_dir, "ddp", True).out
    adapter = main(["--run", str(run), "--limit", LIMIT])
    assert adapter["models"]["fine_tuned"]["model"] == f"{tiny_model_dir} + adapter {run / 'final'}"
    merged = main(["--run", str(run / "final" / "merged"), "--limit", LIMIT, "--chat-template", "yes"])
    assert merged["models"]["fine_tuned"]["results"][TASK] == adapter["models"]["fine_tuned"]["results"][TASK]


@pytest.mark.launch
@pytest.mark.parametrize("strategy,lora", [("ddp", True), ("fsdp", False), ("fsdp", True), ("zero2", False),
                                           ("zero3", False), ("zero3", True)])
def test_a_checkpoint_of_any_strategy_reads_back_as_the_model_it_exported(runs, tiny_model_dir, strategy, lora,
                                                                        tmp_path):
    """The last checkpoint (step 10) of the strategy matrix's runs, rebuilt in one process from its own layout
    (model.safetensors, FSDP2's DCP shards, DeepSpeed's ZeRO partitions), holds exactly the weights the run
    exported at the end (final/: the whole model, or the adapter)."""
    from peft import get_peft_model_state_dict

    from disttrain.model import from_checkpoint

    run = strategy_run(runs, tiny_model_dir, strategy, lora).out
    checkpoint = run / "checkpoints" / f"step-{STEPS:08d}"
    model, tokenizer, _ = from_checkpoint.load(checkpoint)
    ours = get_peft_model_state_dict(model) if lora else model.state_dict()
    exported = final_weights(run, lora)
    assert set(exported) <= set(ours)
    for key, value in exported.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
    if (strategy, lora) == ("fsdp", False):  # make export's command: a directory from_pretrained loads
        from transformers import AutoModelForCausalLM

        out = from_checkpoint.main([str(checkpoint), str(tmp_path / "exported")])
        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        for key, value in exported.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
        assert tokenizer.chat_template and (out / "tokenizer_config.json").is_file()


@pytest.mark.launch
@pytest.mark.parametrize("strategy", sorted({strategy for strategy, _ in EVALUATED}))
def test_scores_during_training_equal_make_eval_on_the_checkpoints(runs, tiny_model_dir, strategy):
    """The matrix's ZeRO-3 and FSDP2 runs score their checkpoints while training (evaluation: every 5 steps, 10
    examples; test_strategies shows they still train like one process). Their numbers in metrics.jsonl are what
    `make eval` gives afterwards on the same checkpoints, and at the last step what it gives on the exported
    model. (Under FSDP2 the scoring hung until the collective timeout: DCP's reader planned collectively.)"""
    from disttrain.evaluation.__main__ import main
    from disttrain.metrics.log import read_metrics

    run = strategy_run(runs, tiny_model_dir, strategy, False).out
    scored = {r["step"]: r for r in read_metrics(run) if f"lm_eval/{EVAL_TASK}/acc" in r}
    assert sorted(scored) == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    assert all(r["lm_eval_time_s"] > 0 for r in scored.values())
    for step in scored:
        name = f"step-{step:08d}"
        record = main(["--run", str(run / "checkpoints" / name), "--tasks", EVAL_TASK, "--limit", str(EVAL_LIMIT)])
        theirs = record["models"][name]
        assert theirs["model"] == str(run / "checkpoints" / name)
        for metric in ("acc", "acc_norm"):
            assert scored[step][f"lm_eval/{EVAL_TASK}/{metric}"] == theirs["results"][EVAL_TASK][f"{metric},none"]
    final = main(["--run", str(run), "--tasks", EVAL_TASK, "--limit", str(EVAL_LIMIT)])["models"]["fine_tuned"]
    assert final["results"][EVAL_TASK]["acc,none"] == scored[STEPS][f"lm_eval/{EVAL_TASK}/acc"]
    assert scored[CHECKPOINT_EVERY][f"lm_eval/{EVAL_TASK}/acc_norm"] is not None
    assert not list((run / "eval").glob("*.model")), "the checkpoint's temporary export is removed"


@pytest.mark.heavy
def test_bad_input_is_one_line(tmp_path, tiny_model_dir):
    from disttrain.evaluation.__main__ import main

    def error(*argv) -> str:
        with pytest.raises(DisttrainError) as caught:
            main(list(argv))
        message = str(caught.value)
        assert "\n" not in message
        return message

    assert "is not a directory" in error("--run", str(tmp_path / "nowhere"))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text("")
    assert "has no exported model (final/): the run has not finished" in error("--run", str(unfinished))
    model = tiny_model_dir
    assert "unknown task 'disttrain_tiny_choise' (did you mean disttrain_tiny_choice" in \
        error("--run", str(model), "--tasks", "disttrain_tiny_choise")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                     "    test: nowhere/my.jsonl\noutput_type: multiple_choice\ndoc_to_text: q\n"
                                     "doc_to_choice: '{{choices}}'\ndoc_to_target: 0\n")
    assert "its test file nowhere/my.jsonl does not exist" in \
        error("--run", str(model), "--tasks", "my_task", "--include", str(tasks))
    assert "names no base model" in error("--run", str(model), "--base")
    proc = subprocess.run(["make", "-s", "eval"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0] == ("error: give RUN=<a run's output dir, a checkpoint, a model dir or an "
                                           "adapter dir>")
    assert "not a complete checkpoint" in error_of([str(unfinished)])
    from disttrain.evaluation.during_training import CheckpointScorer
    from disttrain.recipe.schema import EvaluationSection

    with pytest.raises(DisttrainError, match="unknown task 'disttrain_tiny_choise'"):  # train.py stops at start-up
        CheckpointScorer(None, EvaluationSection(tasks=["disttrain_tiny_choise"], every_steps=5))


def error_of(argv: list[str]) -> str:
    """make export's one line (python -m disttrain.model.from_checkpoint)."""
    from disttrain.model.from_checkpoint import main

    with pytest.raises(DisttrainError) as caught:
        main(argv)
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("evaluation,checkpoint_every,message", [
    ({"tasks": [TASK]}, 5, "evaluation.tasks is set: give evaluation.every_steps too"),
    ({"tasks": [TASK], "every_steps": 6}, 4, "evaluation.every_steps=6 scores the checkpoints training writes: it "
                                             "must be a multiple of output.checkpoint_every (now 4)"),
    ({"tasks": [TASK], "every_steps": 6}, None, "must be a multiple of output.checkpoint_every (now None)"),
])
def test_evaluation_during_training_is_refused_in_one_line_without_checkpoints_to_score(
        tmp_path, tiny_model_dir, evaluation, checkpoint_every, message):
    from conftest import base_recipe, write_recipe
    from disttrain.recipe.schema import RecipeError, load_recipe

    tree = base_recipe(tiny_model_dir, tmp_path / "out", evaluation=evaluation,
                       output={"checkpoint_every": checkpoint_every})
    with pytest.raises(RecipeError) as caught:
        load_recipe(write_recipe(tmp_path / "r.yaml", tree))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_scores_reach_the_model_card_and_the_report(tmp_path):
    """<run>/eval/results.json (as make eval writes it): the card gains an Evaluation table (fine-tuned beside
    base, with standard errors) and the Hub's model-index; `make report` gains a column per task and metric,
    '-' for a run not evaluated on it."""
    import yaml
    from disttrain.report import summary_row, summary_table
    from disttrain.report.card import model_card

    def run(name: str, scores: dict | None):
        out = tmp_path / "runs" / name
        (out / "final").mkdir(parents=True)
        (out / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": "Qwen/Qwen2.5-7B-Instruct"},
                                                         "training": {"lr": 1e-5}}))
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
        if scores is not None:
            (out / "eval").mkdir()
            (out / "eval" / "results.json").write_text(json.dumps(scores))
        return out

    results = {"models": {"fine_tuned": {"model": "x/final", "results": {TASK: {
                   "acc,none": 0.6, "acc_stderr,none": 0.1}, "disttrain_tiny_generate": {"exact_match,strip": 0.35}}},
               "base": {"model": "Qwen/Qwen2.5-7B-Instruct", "results": {TASK: {"acc,none": 0.25,
                                                                               "acc_stderr,none": 0.09}}}},
               "lm_eval": "0.4.13", "chat_template": True, "limit": 20}
    evaluated, plain = run("evaluated", results), run("plain", None)
    card = model_card(evaluated)
    header = yaml.safe_load(card.split("---")[1])
    (entry,) = header["model-index"]
    metrics = {(r["dataset"]["name"], m["type"]): m["value"] for r in entry["results"] for m in r["metrics"]}
    assert metrics == {(TASK, "acc"): 0.6, ("disttrain_tiny_generate", "exact_match (strip)"): 0.35}
    assert f"| {TASK} | acc | 0.6000 ± 0.1000 | 0.2500 ± 0.0900 |" in card
    assert "| disttrain_tiny_generate | exact_match (strip) | 0.3500 | - |" in card
    assert "at most 20 examples per task" in card and "## Evaluation" not in model_card(plain)
    table = summary_table([summary_row(evaluated), summary_row(plain)]).splitlines()
    assert table[0].endswith(f"| {TASK} acc | disttrain_tiny_generate exact_match (strip) |")
    assert table[2].endswith("| 0.6 | 0.35 |") and table[3].endswith("| - | - |")


def test_scoring_during_training_puts_the_random_generators_back():
    """lm-eval seeds python's, numpy's and torch's generators; training continues from the states it had (the
    control: the same seeding outside the guard changes what training draws next)."""
    import random

    import numpy as np

    from disttrain.evaluation.during_training import _rng_put_back

    def lm_eval_seeding():
        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = draws()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    with _rng_put_back():
        lm_eval_seeding()
    assert draws() == expected
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    lm_eval_seeding()
    assert all(a != b for a, b in zip(draws(), expected))


@pytest.mark.launch
def test_the_other_ranks_outlast_a_scoring_longer_than_the_collective_timeout(tiny_model_dir, tmp_path):
    """distributed.timeout_s=8 and a scoring that takes 15 s (tests/slow_save delays it on the main process): the
    other rank waits polling the store, not in a collective, and the run finishes with its scores (it waited in
    a broadcast and died at the collective timeout)."""
    from conftest import base_recipe, write_recipe
    from disttrain.metrics.log import read_metrics

    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, tmp_path / "out", training={"max_steps": 2}, output={"checkpoint_every": 2},
        evaluation={"tasks": [EVAL_TASK], "every_steps": 2, "limit": 3}, distributed={"timeout_s": 8}))
    slow = {"PYTHONPATH": str(REPO / "tests" / "slow_save"), "DISTTRAIN_TEST_SCORE_DELAY_S": "15"}
    proc = launch("ddp", recipe, env=slow)
    assert_ok(proc)
    assert "test: scoring delayed by 15 s" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "out") if f"lm_eval/{EVAL_TASK}/acc" in r] == [2]

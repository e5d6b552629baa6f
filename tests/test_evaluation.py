"""`make eval` (disttrain/evaluation): lm-evaluation-harness on a run's exported model and its base, on the
project's own local task (eval_tasks/disttrain_tiny, over data/tiny_tasks_eval.jsonl). The numbers are lm-eval's:
`make eval` gives exactly what lm-eval's own command line gives on the same model, prompts and examples; a LoRA
run is evaluated as its adapter on the base, equal to its merged export; bad input is one line."""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from disttrain.errors import DisttrainError
from strategy_runs import strategy_run

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
    assert proc.stderr.splitlines()[0] == "error: give RUN=<a run's output dir, a model dir or an adapter dir>"


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

"""<run>/eval/results.json (written by `make eval`, disttrain/evaluation): read back for the model card's
"Evaluation" section and model-index, and for `make report`'s comparison of runs. The file is the interface;
the numbers are lm-eval's, named as lm-eval names them (`metric,filter`)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path("eval") / "results.json"
MODELS = ("fine_tuned", "base")  # the columns, in this order


def read(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / RESULTS
    return json.loads(path.read_text()) if path.is_file() else None


def scores(record: dict, model: str = "fine_tuned") -> dict[str, float]:
    """{"task metric": value} of one model, standard errors left out: one number per task and metric."""
    results = record["models"].get(model, {}).get("results", {})
    return {f"{task} {_metric_name(name)}": value for task, values in sorted(results.items())
            for name, value in sorted(values.items()) if "_stderr" not in name}


def _metric_name(name: str) -> str:
    metric, _, filt = name.partition(",")
    return metric if filt in ("", "none") else f"{metric} ({filt})"


def table(record: dict, tasks: list[str] | None = None, models: list[str] | None = None) -> str:
    """| task | metric | fine-tuned | base |, each value with its standard error; `models`: other columns (the
    checkpoints a `make eval` scored, step-00000120)."""
    models = models or [k for k in MODELS if k in record["models"]]
    first = record["models"][models[0]]["results"]
    lines = ["| task | metric | " + " | ".join(k.replace("_", "-") for k in models) + " |",
             "|---|---|" + "---|" * len(models)]
    for task in tasks or sorted(first):
        for name in sorted(k for k in first.get(task, {}) if "_stderr" not in k):
            metric, _, filt = name.partition(",")
            cells = []
            for key in models:
                values = record["models"][key]["results"].get(task, {})
                err = values.get(f"{metric}_stderr,{filt}")
                cells.append(f"{values[name]:.4f}" + (f" ± {err:.4f}" if isinstance(err, float) else "")
                             if name in values else "-")
            lines.append(f"| {task} | {_metric_name(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_index(record: dict) -> list:
    """The fine-tuned model's numbers as the Hub's model-index entries (huggingface_hub.EvalResult)."""
    from huggingface_hub import EvalResult

    results = record["models"].get("fine_tuned", {}).get("results", {})
    return [EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                       metric_type=_metric_name(name), metric_value=value, metric_name=_metric_name(name),
                       source_name="lm-evaluation-harness",
                       source_url="https://github.com/EleutherAI/lm-evaluation-harness")
            for task, values in sorted(results.items()) for name, value in sorted(values.items())
            if "_stderr" not in name]

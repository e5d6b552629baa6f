"""One row per run: what was trained, how, and what came out."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from disttrain.metrics.log import read_metrics
from disttrain.report import eval_results


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v == v)  # without NaN
    return values[len(values) // 2] if values else None


def summary_row(run_dir: str | Path) -> dict:
    """The numbers a comparison needs, from the files a run leaves (missing ones give None)."""
    run = Path(run_dir)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text()) if (run / "recipe.yaml").is_file() else {}
    facts = _read_json(run / "run.json")
    records = read_metrics(run) if (run / "metrics.jsonl").is_file() else []
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    training = recipe.get("training", {})
    total = facts.get("total_steps")
    step = train[-1]["step"] if train else 0
    return {
        "run": str(run), "strategy": facts.get("strategy"), "processes": facts.get("processes"),
        "objective": training.get("objective", "sft"), "lora": recipe.get("lora") is not None,
        "lr": training.get("lr"), "global_batch": facts.get("global_batch"),
        "step": step, "total_steps": total,
        "complete": (run / "final").is_dir() or (total is not None and step >= total),
        "train_loss": train[-1]["loss"] if train else None, "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s_per_device": _median([r["tokens_per_s_per_device"] for r in train[1:] or train
                                            if "tokens_per_s_per_device" in r]),
        "mfu": _median([r["mfu"] for r in train[1:] or train if "mfu" in r]),
        "resumes": sum(1 for r in records if "resumed_from_step" in r),
        # `make eval`'s numbers of the fine-tuned model ({"task metric": value}), compared across runs
        "eval": eval_results.scores(evaluation) if (evaluation := eval_results.read(run)) else {},
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


COLUMNS = (("run", "run"), ("strategy", "strategy"), ("processes", "procs"), ("objective", "objective"),
           ("lora", "lora"), ("lr", "lr"), ("global_batch", "batch"), ("step", "step"), ("total_steps", "of"),
           ("train_loss", "train loss"), ("eval_loss", "eval loss"), ("tokens_per_s_per_device", "tok/s/dev"),
           ("mfu", "MFU"), ("resumes", "resumes"))


def summary_table(rows: list[dict]) -> str:
    """A Markdown table of summary rows (one per run); then one column per task and metric that `make eval`
    scored in any of them ("-" where a run was not evaluated on it)."""
    scored = sorted({name for row in rows for name in row.get("eval", {})})
    header = "| " + " | ".join([*(title for _, title in COLUMNS), *scored]) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + len(scored))]
    for row in rows:
        cells = [_cell(row[key]) if key != "mfu" or row[key] is None else f"{row[key]:.1%}" for key, _ in COLUMNS]
        cells += [_cell(row.get("eval", {}).get(name)) for name in scored]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

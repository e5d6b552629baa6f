"""final/README.md: a model card in the Hub's format, written from the run's own files."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from disttrain.report import eval_results
from disttrain.report.table import summary_row

CARD = "README.md"


def _hub_id(name: str | None) -> str | None:
    """A Hub repo id (org/name), not a local path."""
    if not name or name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") != 1:
        return None
    return name


def _data_lines(recipe: dict, report: dict) -> list[str]:
    data = recipe.get("data", {})
    sources = data.get("sources") or [{"path": data.get("path"), "format": data.get("format")}]
    lines = [f"- `{s.get('path')}` ({s.get('format')}" + (f", weight {s['weight']}" if "weight" in s else "") + ")"
             for s in sources]
    train = report.get("train")
    if train:
        lines.append(f"- {train['examples']} examples -> {train['rows']} rows, {train['target_tokens']} target "
                     f"tokens, {train['tokens']} tokens per epoch (max_seq_len {data.get('max_seq_len')})")
    elif data.get("streaming"):
        lines.append("- read as a stream (data.streaming)")
    return lines


def model_card(run_dir: str | Path) -> str:
    from huggingface_hub import ModelCardData

    run = Path(run_dir)
    recipe_text = (run / "recipe.yaml").read_text() if (run / "recipe.yaml").is_file() else ""
    recipe = yaml.safe_load(recipe_text) or {}
    facts = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    report = json.loads((run / "data_report.json").read_text()) if (run / "data_report.json").is_file() else {}
    row = summary_row(run)
    base = recipe.get("model", {}).get("name_or_path")
    lora = recipe.get("lora") is not None
    objective = row["objective"]
    sources = (recipe.get("data", {}).get("sources") or [recipe.get("data", {})])
    evaluation = eval_results.read(run)  # `make eval`: lm-eval's numbers, in the Hub's model-index too
    header = ModelCardData(
        model_name="/".join(run.parts[-2:]) if evaluation else None,
        eval_results=eval_results.model_index(evaluation) if evaluation else None,
        base_model=_hub_id(base), library_name="peft" if lora else "transformers",
        license="other",  # a placeholder: set the license your base model and data allow
        datasets=[d for d in (_hub_id(s.get("path")) for s in sources) if d] or None,
        tags=["disttrain", objective, *(["lora"] if lora else []),
              *([facts["strategy"]] if "strategy" in facts else [])])
    kind = "SequenceClassification" if objective == "reward" else "CausalLM"  # a reward model scores
    labels = ", num_labels=1" if objective == "reward" else ""  # the base loads with the one-label head
    loader = (f"from peft import AutoPeftModelFor{kind}\n\n"
              f"model = AutoPeftModelFor{kind}.from_pretrained(\"<this directory>\"{labels})  # loads the base too"
              if lora else
              f"from transformers import AutoModelFor{kind}, AutoTokenizer\n\n"
              f"model = AutoModelFor{kind}.from_pretrained(\"<this directory>\")")
    results = _results(run, row, objective)
    hardware = (f"{facts.get('strategy')}, {facts.get('processes')} process(es) on {facts.get('device')} "
                f"({facts.get('device_name')}), {facts.get('mixed_precision')} precision, global batch "
                f"{facts.get('global_batch')}") if facts else "unknown (no run.json)"
    body = [
        f"# {'/'.join(run.parts[-2:])}", "",
        f"{'LoRA adapter for' if lora else 'Fine-tuned from'} `{base}` with disttrain "
        f"({objective.upper()}{', LoRA r=' + str(recipe['lora'].get('r')) if lora else ', full weights'}).", "",
        "## Training", "", f"- hardware and strategy: {hardware}", *_data_lines(recipe, report), "",
        "| result | value |", "|---|---|",
        *[f"| {name} | {value if not isinstance(value, float) else f'{value:.4g}'} |" for name, value in results
          if value is not None], "",
        "![training curves](../plots/overview.png)", "",
        *(["## Evaluation", "", f"lm-evaluation-harness {evaluation.get('lm_eval')} (`make eval`), "
           f"{'chat template applied' if evaluation.get('chat_template') else 'plain prompts'}"
           f"{', at most ' + str(evaluation['limit']) + ' examples per task' if evaluation.get('limit') else ''}; "
           "the base model with the same tokenizer and prompts:", "", eval_results.table(evaluation), ""]
          if evaluation else []),
        "## How to load", "", "```python", loader, "```", "",
        "## Recipe", "", "The exact recipe of this run (overrides applied):", "",
        "```yaml", recipe_text.rstrip(), "```",
    ]
    return "---\n" + header.to_yaml() + "\n---\n\n" + "\n".join(body) + "\n"


def write_model_card(run_dir: str | Path) -> Path:
    path = Path(run_dir) / "final" / CARD
    path.write_text(model_card(run_dir))
    return path


def _results(run: Path, row: dict, objective: str) -> list[tuple[str, object]]:
    """The card's results table: steps, losses, speed, and what the objective adds (pair accuracy, the reward)."""
    results = [("steps", f"{row['step']} of {row['total_steps']}" if row["total_steps"] else row["step"]),
               ("final train loss", row["train_loss"]), ("final eval loss", row["eval_loss"]),
               ("tokens/s per device (median)", row["tokens_per_s_per_device"]),
               ("MFU (median)", f"{row['mfu']:.1%}" if row["mfu"] is not None else None)]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").is_file() else []
    if objective in ("dpo", "reward"):
        evals = [r for r in records if "eval_rewards/accuracy" in r]
        results.append(("eval reward accuracy", evals[-1]["eval_rewards/accuracy"] if evals else None))
    if objective == "grpo":  # online RL: the reward at the first and the last log line
        rewards = [r["reward"] for r in records if "reward" in r]
        results.append(("reward (first -> last log line)", f"{rewards[0]:.4g} -> {rewards[-1]:.4g}" if rewards
                        else None))
    return results

"""`make eval RUN=<run dir | checkpoint | model dir | adapter dir> TASKS=a,b [BASE=1] [LIMIT=n] [INCLUDE=dir]`:
lm-evaluation-harness on the run's model (and, with BASE=1, on the base model it was fine-tuned from, with the
same tokenizer and prompts); the numbers go to <run>/eval/results.json and are printed side by side. A checkpoint
(<run>/checkpoints/step-N, any strategy) is exported to a model dir first and scored in a column of its own.

    python -m disttrain.evaluation --run outputs/tiny-sft/ddp-2 --tasks disttrain_tiny_choice --base
    python -m disttrain.evaluation --run outputs/qwen-run --tasks arc_easy,hellaswag --base   # lm-eval's tasks
    accelerate launch --multi_gpu --num_processes 8 -m disttrain.evaluation --run ...       # data-parallel

Tasks: lm-eval's registry (downloaded from the Hub where it is reachable) and local task YAMLs: the project's
eval_tasks/ (disttrain_tiny_choice, disttrain_tiny_generate: its synthetic data, no network) and yours
(--include dir). Prompts go through the model's chat template when its tokenizer has one (--chat-template).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.evaluation import harness
from disttrain.evaluation.target import opened
from disttrain.report import eval_results
from disttrain.report.card import CARD, write_model_card

RESULTS = eval_results.RESULTS


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run's output dir, a checkpoint, a model dir or an adapter dir")
    parser.add_argument("--tasks", default="disttrain_tiny_choice", help="comma-separated lm-eval task names")
    parser.add_argument("--base", action="store_true", help="also evaluate the base model it was fine-tuned from")
    parser.add_argument("--include", action="append", default=[], help="a directory of your own task YAMLs")
    parser.add_argument("--limit", type=int, help="at most this many examples per task (a quick look)")
    parser.add_argument("--batch-size", default=None, help="default: auto on a GPU, 8 on the CPU")
    parser.add_argument("--chat-template", choices=["auto", "yes", "no"], default="auto",
                        help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    args = parser.parse_args(argv)

    tasks = [t for t in args.tasks.split(",") if t]
    manager = harness.task_manager(args.include, tasks)
    harness.check_tasks(manager, tasks)
    with opened(args.run) as target:
        return _evaluate(args, target, tasks, manager)


def _evaluate(args, target, tasks: list[str], manager) -> dict | None:
    import torch

    if args.base and target.base is None:
        raise DisttrainError(f"make eval: BASE=1, but {args.run} names no base model (no adapter config, no "
                             "recipe.yaml beside it); evaluate the base separately with RUN=<its dir or name>")
    tokenizer = target.model.adapter or target.model.pretrained  # the run's tokenizer, for both models
    chat = args.chat_template == "yes" or (args.chat_template == "auto" and harness.has_chat_template(tokenizer))
    gpu = torch.cuda.is_available()
    batch = args.batch_size or ("auto" if gpu else 8)
    models = {target.key: target.model, **({"base": target.base} if args.base else {})}
    scored = {}
    for key, model in models.items():
        results = harness.evaluate(model, tasks, manager, tokenizer, chat, args.limit, batch, "cuda" if gpu else "cpu")
        if results is None:
            return None  # a data-parallel launch: the first process writes
        scored[key] = {"model": model.label, "results": harness.metrics(results)}
    record = _save(target.out_dir / RESULTS, scored, chat, args.limit, results)
    print(eval_results.table(record, tasks, list(scored)))
    print(f"eval: {target.out_dir / RESULTS}")
    if (target.out_dir / "final" / CARD).is_file():  # a run whose card was written: it gains the numbers
        print(f"eval: model card updated: {write_model_card(target.out_dir)}")
    return record


def _save(path: Path, scored: dict, chat: bool, limit: int | None, raw: dict) -> dict:
    """Merge into results.json: a task evaluated again replaces its numbers, other tasks stay."""
    record = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    for key, entry in scored.items():
        previous = record["models"].get(key, {})
        results = previous.get("results", {}) if previous.get("model") == entry["model"] else {}
        record["models"][key] = {"model": entry["model"], "results": {**results, **entry["results"]}}
    record.update(lm_eval=raw.get("lm_eval_version") or _lm_eval_version(), chat_template=chat, limit=limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def _lm_eval_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lm_eval")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

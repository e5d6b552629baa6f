"""lm-evaluation-harness, called through its Python API: its `hf` model (transformers, peft adapters), its task
registry and local task YAMLs (`include_path`; the project's own under eval_tasks/). Its failures for bad input
(an unknown task, a local task whose data file is missing) are checked first and said in one line."""

from __future__ import annotations

import difflib
from pathlib import Path

from disttrain.errors import DisttrainError
from disttrain.evaluation.target import Model

LOCAL_TASKS = Path(__file__).resolve().parents[2] / "eval_tasks"  # the project's own (over its synthetic data)


def task_manager(include: list[str], tasks: list[str]):
    """lm-eval's task index over the local YAMLs, and over its whole registry only when a task is not local
    (indexing its ~15k tasks takes ~14 s here)."""
    from lm_eval.tasks import TaskManager

    paths = [str(LOCAL_TASKS), *include]
    for path in include:
        if not Path(path).is_dir():
            raise DisttrainError(f"make eval: INCLUDE={path} is not a directory of lm-eval task YAMLs")
    local = TaskManager(include_path=paths, include_defaults=False)
    return local if set(tasks) <= set(local.all_tasks) else TaskManager(include_path=paths)


def check_tasks(manager, tasks: list[str]) -> None:
    """Every task is known to lm-eval (its registry or a local YAML), and a local task's data files exist."""
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            raise DisttrainError(f"make eval: unknown task {task!r}" + (f" (did you mean {', '.join(close)}?)"
                                 if close else "") + "; `lm_eval ls tasks` lists lm-eval's, eval_tasks/ holds "
                                 "this project's; add your own YAMLs with INCLUDE=dir")
        _check_data_files(manager, task)


def _check_data_files(manager, task: str) -> None:
    entry = manager.task_index.get(task)
    config, yaml_path = (getattr(entry, "cfg", None) or {}), getattr(entry, "yaml_path", None)
    if config.get("dataset_path") not in ("json", "csv", "parquet", "text"):
        return  # a Hub dataset: lm-eval (datasets) downloads it
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    for split, names in (files.items() if isinstance(files, dict) else [("data", files)]):
        for name in [names] if isinstance(names, str) else names:
            if not Path(name).is_file():
                raise DisttrainError(f"make eval: task {task} ({yaml_path}): its {split} file {name} does not exist "
                                     "(paths in a task YAML are relative to the directory make eval runs in: "
                                     "the repository root)")


def model_args(model: Model, tokenizer_dir: str | None) -> dict:
    args = {"pretrained": model.pretrained, "dtype": "auto"}
    if model.adapter:
        args["peft"] = model.adapter
    if tokenizer_dir:
        args["tokenizer"] = tokenizer_dir  # the run's tokenizer (chat template included), saved with its model
    return args


def has_chat_template(tokenizer_dir: str) -> bool:
    from transformers import AutoTokenizer

    return bool(getattr(AutoTokenizer.from_pretrained(tokenizer_dir), "chat_template", None))


def evaluate(model: Model, tasks: list[str], manager, tokenizer_dir: str | None, chat_template: bool,
             limit: int | None, batch_size: str | int, device: str) -> dict | None:
    """lm-eval's results dict (None on every process but the first of a data-parallel launch)."""
    import lm_eval

    return lm_eval.simple_evaluate(model="hf", model_args=model_args(model, tokenizer_dir), tasks=tasks,
                                   task_manager=manager, limit=limit, batch_size=batch_size, device=device,
                                   apply_chat_template=chat_template, log_samples=False)


def evaluate_loaded(model, tokenizer, tasks: list[str], manager, chat_template: bool, limit: int | None,
                    batch_size: str | int) -> dict:
    """lm-eval on a model already in memory (evaluation during training): its `hf` model wraps the object, on the
    device it is on, as one process (lm-eval sets up no data-parallel group for a model object)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                   apply_chat_template=chat_template, log_samples=False)


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {"acc,none": 0.26, "acc_stderr,none": 0.044, ...}}: lm-eval's own metric names (metric,filter)."""
    return {task: {k: v for k, v in values.items() if "," in k and isinstance(v, (int, float))}
            for task, values in results["results"].items()}

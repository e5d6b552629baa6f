"""`make eval`: a run's model (or any model dir) scored by lm-evaluation-harness, next to its base model.

    target.py   what to evaluate: a run dir's exported model (final/: a whole model or a LoRA adapter), a
                checkpoint (exported for the evaluation), a model dir, an adapter dir; the base model
    harness.py  lm-eval's Python API on its `hf` model and task registry (plus local task YAMLs, as
                eval_tasks/), its errors as one line; the metrics of each task
    __main__.py the command: evaluates, writes <run>/eval/results.json, prints base vs fine-tuned
    during_training.py  the recipe's evaluation: section: the checkpoints scored while training

Nothing here scores a model itself: lm-eval does (its tasks, prompts, metrics); this package picks the model
and the tasks, and keeps the numbers with the run.
"""

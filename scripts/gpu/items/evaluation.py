"""The evaluation item: lm-evaluation-harness during training on the GPU (the recipe's evaluation: section) and
`make eval` on the same checkpoint afterwards, the same numbers."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, read_metrics, recipe, train

TASK, LIMIT = "disttrain_tiny_choice", 40


def eval_during_training(ctx: Ctx) -> tuple[str, str]:
    """bf16 training under one GPU with evaluation.tasks every N steps: the main process rebuilds the model from
    the checkpoint on its GPU beside the training state and scores it (lm-eval's hf model on a model object);
    then `make eval RUN=<that checkpoint>` (exported, lm-eval loading it by path on the GPU) gives the same acc."""
    ok, why = ctx.importable("lm_eval")
    if not ok:
        raise Fail(f"lm_eval does not import: {why}")
    n = ctx.s.steps
    run = ctx.item_dir / "run"
    tree = recipe(ctx, run, output={"checkpoint_every": n, "save_final_model": False},
                  evaluation={"tasks": [TASK], "every_steps": n, "limit": LIMIT, "batch_size": 8})
    _, log = train(ctx, "run", "single_gpu", tree)
    scored = [r for r in read_metrics(run) if f"lm_eval/{TASK}/acc" in r]
    if [r["step"] for r in scored] != [n]:
        raise Fail(f"metrics.jsonl has lm_eval/{TASK}/acc at steps {[r['step'] for r in scored]}, expected [{n}]",
                   log)
    from disttrain.evaluation.__main__ import main as make_eval

    name = f"step-{n:08d}"
    with ctx.lock:  # from_pretrained patches torch's init functions while it builds: one at a time
        record = make_eval(["--run", str(run / "checkpoints" / name), "--tasks", TASK, "--limit", str(LIMIT),
                            "--batch-size", "8"])
    theirs = record["models"][name]["results"][TASK]["acc,none"]
    ours = scored[0][f"lm_eval/{TASK}/acc"]
    ctx.figures.update(acc_during_training=ours, acc_make_eval=theirs, lm_eval_time_s=scored[0]["lm_eval_time_s"])
    if ours != theirs:
        raise Fail(f"acc during training {ours} != make eval on {name} {theirs}", log)
    return PASS, f"acc {ours:.3f} during training == make eval on the checkpoint; scored in " \
                 f"{scored[0]['lm_eval_time_s']:.1f} s"

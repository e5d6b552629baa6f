"""KTO (preference.loss: kto) launched as a user would: the shipped tiny recipe (unpaired feedback, full
fine-tuning, the reference log-probs of every example and its KL partner precomputed) under ddp, fsdp, hsdp
(2 x 2), zero1 and zero3 (through `make train-zero3`, the real `accelerate launch`) trains the model one
process trains -- per-step loss, z (the KL estimate all-reduced over the ranks), the per-class rewards, the
evaluations and the exported weights -- and the desirable-minus-undesirable margin rises. LoRA KTO (the
adapters disabled as the reference) on pairs split in two runs in the matrix's preference runs
(tests/test_matrix.py). Under ddp, hsdp and zero3 the examples are padding-free (data.packing: the examples'
rows apart from their partners'), so those runs also prove padding-free KTO equal to one padded process.
Tolerances as in test_preference_launch.py (fp32: only summation order differs)."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_ok, launch, write_recipe
from disttrain.metrics.log import read_metrics
from disttrain.recipe.schema import load_recipe, recipe_to_dict
from strategy_runs import make_train

pytestmark = pytest.mark.launch

STEPS = 12
PADDING_FREE = ("ddp", "hsdp", "zero3")  # data.packing; the one process they are compared with: padded
METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "logps/rejected",
           "eval_loss", "eval_kl", "eval_rewards/margin")


def kto_run(runs, model_dir, strategy: str):
    """The shipped recipe for STEPS steps, 16 examples a step in 2 micro-steps of 8 (z's groups): one process with
    micro-batches of 8, two with 4 each, or four (hsdp) with 2 each; the same model. Launched once per session.
    (out dir, stdout)."""
    def make(folder):
        processes = {"single_gpu": 1, "hsdp": 4}.get(strategy, 2)
        recipe = load_recipe(REPO / "recipes/tiny/kto.yaml", [
            f"model.name_or_path={model_dir}", f"output.dir={folder / 'run'}", f"training.max_steps={STEPS}",
            f"training.micro_batch_size={8 // processes}", "training.eval_every=6", "logging.every_steps=2",
            "logging.report_to=[]", "output.checkpoint_minutes=null",
            f"data.packing={str(strategy in PADDING_FREE).lower()}"])
        tree = recipe_to_dict(recipe)
        for key in ("path", "eval_path"):
            tree["data"][key] = str(REPO / tree["data"][key])
        path = write_recipe(folder / "kto.yaml", tree)
        if strategy == "zero3":  # through the real launcher, as a user types it (the others: the warm one)
            return folder / "run", make_train("train-zero3", path, "GPUS=2")
        proc = launch(strategy, path, nproc=processes)
        assert_ok(proc)
        return folder / "run", proc.stdout
    return runs.get(f"kto-{strategy}", make)


def logged(out) -> dict[tuple[int, str], float]:
    return {(r["step"], k): v for r in read_metrics(out) for k, v in r.items() if k in METRICS}


def test_the_tiny_kto_recipe_learns_the_preference(runs, tiny_model_dir):
    out, stdout = kto_run(runs, tiny_model_dir, "single_gpu")
    assert "KTO: 427 desirable and 373 undesirable examples" in stdout
    assert "reference log-probs of 864 examples computed" in stdout  # 800 training + 64 eval examples
    margins = [v for (_, k), v in sorted(logged(out).items()) if k == "rewards/margin"]
    assert len(margins) == STEPS // 2 and margins[-1] > margins[0] + 2.0, margins
    evals = [v for (_, k), v in sorted(logged(out).items()) if k == "eval_rewards/margin"]
    assert len(evals) == 2 and evals[-1] > 1.0, evals
    assert any(v > 0 for (_, k), v in logged(out).items() if k == "kl")  # z is estimated, not always clamped


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp", "zero1", "zero3"])
def test_kto_trains_like_one_process(strategy, runs, tiny_model_dir):
    single, _ = kto_run(runs, tiny_model_dir, "single_gpu")
    out, _ = kto_run(runs, tiny_model_dir, strategy)
    ours, theirs = logged(out), logged(single)
    assert sorted(ours) == sorted(theirs)
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-5)
    wa, wb = load_file(single / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert set(wa) == set(wb)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-4, rtol=1e-3, msg=f"{strategy}: {key}")

"""Packing items: packed examples isolated under sdpa and flash-attention (model level, packing_isolation.py),
the same eval loss packed and unpacked through train.py, and preference pairs padding-free as padded."""

from __future__ import annotations

import json
import math
import sys

from harness import PASS, REPO, Ctx, Fail, Skip, error_line, read_metrics, recipe, run_cmd, train

PACKING_SCRIPT = REPO / "scripts/gpu/packing_isolation.py"

def packing(ctx: Ctx, attn: str) -> tuple[str, str]:
    """Model level (packing_isolation.py) and training level (eval loss of the initial weights, packed vs
    unpacked, through train.py)."""
    if attn.startswith("flash_attention"):
        ok, why = ctx.importable("flash_attn")
        if not ok:
            raise Skip(f"flash_attn does not import ({why}): carry a flash-attn wheel built for this torch/CUDA")
    if not PACKING_SCRIPT.is_file():
        raise Fail(f"{PACKING_SCRIPT.relative_to(REPO)} is missing")
    out = ctx.item_dir / "isolation.json"
    proc, log = run_cmd(ctx, "isolation", [sys.executable, str(PACKING_SCRIPT), "--model", str(ctx.model_dir),
                                           "--attn", attn, "--device", ctx.s.device, "--dtype", ctx.s.dtype,
                                           "--json", str(out)])
    if not out.is_file():  # it exits 1 when not isolated, with its report written: that is judged below
        raise Fail(f"packing_isolation.py exit {proc.returncode}, no report: {error_line(proc)}", log)
    isolation = json.loads(out.read_text())
    ctx.figures.update({k: v for k, v in isolation.items() if isinstance(v, (bool, int, float, str))})
    if not isolation["isolated"]:
        raise Fail(f"packing_isolation.py: packed examples are not isolated under {attn} "
                   f"(max abs diff {isolation['max_abs_diff']:.3g})", log)
    evals = {label: _eval_at_init(ctx, label, attn, {"packing": label == "packed", "eval_fraction": 0.2})
             for label in ("packed", "unpacked")}
    rel = abs(evals["packed"] - evals["unpacked"]) / abs(evals["unpacked"])
    ctx.figures.update(eval_loss_packed=evals["packed"], eval_loss_unpacked=evals["unpacked"], eval_rel_diff=rel)
    if rel > ctx.s.eval_rtol:
        raise Fail(f"eval loss at init: packed {evals['packed']:.6g} vs unpacked {evals['unpacked']:.6g} "
                   f"(rel {rel:.3g} > {ctx.s.eval_rtol:g})")
    pairs_rel = _padding_free_pairs(ctx, attn)
    return PASS, (f"isolated (max abs diff {isolation['max_abs_diff']:.2g}); eval loss at init packed "
                  f"{evals['packed']:.5g} = unpacked {evals['unpacked']:.5g} (rel {rel:.2g} <= {ctx.s.eval_rtol:g}); "
                  f"preference pairs padding-free = padded (rel {pairs_rel:.2g})")


def _padding_free_pairs(ctx: Ctx, attn: str) -> float:
    """Preference pairs padding-free (flash: one row, its boundaries to the varlen kernel) vs padded: ORPO's eval
    loss of the initial weights (reference-free: the policy's own log-probs, so the layout shows) through
    train.py. Returns the relative difference."""
    data = {"path": str(REPO / "data/tiny_dpo.jsonl"), "format": "preference",
            "eval_path": str(REPO / "data/tiny_dpo_eval.jsonl"), "max_seq_len": min(ctx.s.seq, 128)}
    evals = {label: _eval_at_init(ctx, label, attn, {**data, "packing": packed}, {"objective": "dpo"},
                                  preference={"loss": "orpo"})
             for label, packed in (("pairs_padding_free", True), ("pairs_padded", False))}
    rel = abs(evals["pairs_padding_free"] - evals["pairs_padded"]) / abs(evals["pairs_padded"])
    ctx.figures.update(pairs_eval_loss_padding_free=evals["pairs_padding_free"],
                       pairs_eval_loss_padded=evals["pairs_padded"], pairs_eval_rel_diff=rel)
    if rel > ctx.s.eval_rtol:
        raise Fail(f"preference pairs, eval loss at init: padding-free {evals['pairs_padding_free']:.6g} vs padded "
                   f"{evals['pairs_padded']:.6g} (rel {rel:.3g} > {ctx.s.eval_rtol:g})")
    return rel


def _eval_at_init(ctx: Ctx, label: str, attn: str, data: dict, training: dict | None = None, **sections) -> float:
    """train.py's eval loss of the initial weights under `attn`: it evaluates only after a step, and with lr 1e-30
    that step moves no fp32 master weight (an Adam update is ~lr), so the eval at step 1 is the initial weights'."""
    run = ctx.item_dir / label
    tree = recipe(ctx, run, model={"attn_implementation": attn}, data=data,
                  training={**(training or {}), "max_steps": 1, "lr": 1e-30, "lr_scheduler": "constant",
                            "warmup_steps": 0, "eval_every": 1},
                  output={"save_final_model": False, "checkpoint_at_end": False}, **sections)
    _, log = train(ctx, label, "single_gpu", tree)
    found = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r]
    if len(found) != 1 or not math.isfinite(found[0]):
        raise Fail(f"{label}: expected one finite eval_loss in metrics.jsonl, got {found}", log)
    return found[0]

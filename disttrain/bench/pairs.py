"""`make bench-pairs`: preference tuning padded vs padding-free (data.packing) on long-tailed lengths, in one run.

    python -m disttrain.bench.pairs                        # tiny DPO recipe, 512 generated pairs, 24 steps x 3
    python -m disttrain.bench.pairs --steps 10 --repeats 1  # a quick look

Generated pairs (not timed) whose responses have a long tail of lengths, as real preference data has
(UltraFeedback's answers: most short, a few near the limit): each response's word count is drawn from a
log-normal distribution, capped by max_seq_len. The tiny DPO recipe trains on them twice per repeat, padded (each
sequence its own row, padded to the micro-batch's longest) and padding-free (the micro-batch's sequences packed
into as few rows as hold them), a real `accelerate launch` of train.py each, interleaved so a slow minute of the
machine hits both alike; the launch of median time is kept. Per mode: real (non-padding) tokens per second over
the steps after warm-up, the padded tokens the model computed per real token, and whether every step's loss
equals the padded run's (the same pairs in the same order: the layout changes nothing else). Writes
<out>/results.json and results.md (default bench/pairs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
from pathlib import Path

from disttrain.bench.strategies import run_strategy
from disttrain.errors import DisttrainError, exit_on_user_error

WORDS = ("apple river stone tiger paper garden table violet ocean music planet silver green cloud bridge "
         "rocket candle forest winter mountain").split()
MODES = {"padded": ("data.packing=false",), "padding-free": ("data.packing=true",)}


def long_tailed_pairs(n: int, seed: int, median_words: int, sigma: float, max_words: int) -> list[dict]:
    """{prompt, chosen, rejected} records; every text's word count log-normal (median `median_words`)."""
    rng = random.Random(seed)

    def text() -> str:
        words = min(max_words, max(1, round(median_words * math.exp(rng.gauss(0.0, sigma)))))
        return " ".join(rng.choices(WORDS, k=words))
    return [{"prompt": "Continue the list. " + text(), "chosen": text(), "rejected": text()} for _ in range(n)]


def summarize(mode: str, records: list[dict], warmup: int) -> dict:
    kept = [r for r in records if r["step"] > warmup]
    if not kept:
        raise DisttrainError(f"bench-pairs: {mode}: no steps after {warmup} warm-up steps; raise --steps")
    seconds = sum(r["step_time_s"] for r in kept)
    tokens = sum(r["tokens"] for r in kept)
    padded = sum(r["padded_tokens_per_s_per_device"] * r["step_time_s"] for r in kept)
    return {"mode": mode, "steps": len(kept), "seconds": seconds, "real_tokens_per_s": tokens / seconds,
            "computed_per_real_token": padded / tokens, "losses": {r["step"]: r["loss"] for r in records}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny/dpo.yaml")
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--median-words", type=int, default=12)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of the lengths (the tail)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (then it is killed)")
    parser.add_argument("--out", default="bench/pairs")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.repeats < 1:
        raise DisttrainError(f"bench-pairs: --steps ({args.steps}) must exceed --warmup ({args.warmup}) and "
                             f"--repeats ({args.repeats}) be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "long_tailed_pairs.jsonl"
    records = long_tailed_pairs(args.pairs, 0, args.median_words, args.sigma, args.max_seq_len // 2)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [f"data.path={data}", "data.format=preference", "data.eval_path=null",
              f"data.max_seq_len={args.max_seq_len}", f"training.micro_batch_size={args.micro_batch_size}",
              "training.grad_accum=1", *args.overrides]
    launches: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for mode, overrides in MODES.items():
            print(f"bench-pairs: {mode} ({repeat + 1}/{args.repeats}) ...", flush=True)
            folder = out / "runs" / f"{mode}-{repeat + 1}"
            steps = run_strategy(args.recipe, "single_gpu", 1, args.steps, folder, [*common, *overrides],
                                 timeout_s=args.timeout)
            launches.setdefault(mode, []).append(summarize(mode, steps, args.warmup))
    rows = []
    for mode, runs in launches.items():
        ordered = sorted(runs, key=lambda r: r["seconds"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["tokens_per_s_launches"] = [r["real_tokens_per_s"] for r in runs]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["speedup"] = row["real_tokens_per_s"] / base["real_tokens_per_s"]
        row["losses_equal"] = all(abs(run["losses"][s] - v) <= 1e-4 * max(1.0, abs(v))
                                  for run in launches[row["mode"]] for s, v in base["losses"].items())
    import torch

    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    lengths = sorted(len(r[side].split()) for r in records for side in ("chosen", "rejected"))
    meta = {"recipe": args.recipe, "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup,
            "micro_batch_size": args.micro_batch_size, "max_seq_len": args.max_seq_len, "device": device,
            "torch": torch.__version__, "response_words": {"median": lengths[len(lengths) // 2],
                                                           "p90": lengths[int(0.9 * len(lengths))],
                                                           "max": lengths[-1]}}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    w = meta["response_words"]
    lines = [f"# Preference pairs, padded vs padding-free: {args.recipe}", "",
             f"{args.pairs} generated pairs, response words median {w['median']}, p90 {w['p90']}, max {w['max']}; "
             f"micro-batch {args.micro_batch_size} pairs, {args.steps} steps ({args.warmup} warm-up), "
             f"{args.repeats} interleaved launches each (median kept); {device}, torch {meta['torch']}", "",
             "| mode | real tokens/s | launches | x padded | tokens computed per real token | losses = padded |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        launched = " / ".join(f"{v:,.0f}" for v in r["tokens_per_s_launches"])
        lines.append(f"| {r['mode']} | {r['real_tokens_per_s']:,.0f} | {launched} | {r['speedup']:.2f} | "
                     f"{r['computed_per_real_token']:.2f} | {'yes' if r['losses_equal'] else 'NO'} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"bench-pairs: wrote {out / 'results.json'}, {out / 'results.md'}")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    with exit_on_user_error():
        main()

"""`make bench-overhead`: disttrain's train.py vs a minimal PyTorch DDP loop vs transformers' Trainer.

Same recipe (model, data, micro-batch, accumulation), same number of processes, one invocation, run one
after the other; effective (non-padding) tokens/s per device after warm-up. Reports the ratios
disttrain/raw (overhead against the floor) and disttrain/Trainer. Writes <out>/overhead.json and .md.
--trainer-unpacked feeds the Trainer padded (unpacked) batches, its default, while train.py and the raw loop
use the recipe's data (e.g. data.packing=true): what a user gains by switching, in one measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from disttrain.bench import run_strategy, summarize
from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.launcher import launch_command, run_logged


def run_peer(mode: str, recipe: str, nproc: int, steps: int, warmup: int, out: Path, overrides) -> float:
    result = out / f"{mode}.json"
    cmd = launch_command("ddp", nproc, "scripts/bench/peers.py", mode, *overrides, "--recipe", recipe,
                         "--steps", str(steps), "--warmup", str(warmup), "--result", str(result))
    proc = run_logged(cmd, out / f"{mode}.log")
    if proc.returncode != 0:
        raise DisttrainError(f"bench-overhead: {mode} failed (exit {proc.returncode}); log: {out / f'{mode}.log'}")
    return json.loads(result.read_text())["tokens_per_s_per_device"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny/sft.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="bench/overhead")
    parser.add_argument("--trainer-unpacked", action="store_true",
                        help="give the Trainer padded batches (data.packing=false), the others the recipe's data")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.steps % args.warmup:
        raise DisttrainError("--steps must be a multiple of --warmup (train.py logs once per warm-up length)")
    # train.py logs (one gather) every `warmup` steps, as a real run would, not every step
    records = run_strategy(args.recipe, "ddp", args.nproc, args.steps, out / "disttrain", args.overrides,
                           log_every=args.warmup)
    ours = summarize("ddp", records, args.warmup)["tokens_per_s_per_device"]
    raw = run_peer("raw", args.recipe, args.nproc, args.steps, args.warmup, out, args.overrides)
    trainer_overrides = [*args.overrides, "data.packing=false"] if args.trainer_unpacked else args.overrides
    trainer = run_peer("trainer", args.recipe, args.nproc, args.steps, args.warmup, out, trainer_overrides)
    result = {"recipe": args.recipe, "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup,
              "overrides": args.overrides, "trainer_unpacked": args.trainer_unpacked,
              "tokens_per_s_per_device": {"disttrain": ours, "raw_ddp": raw, "hf_trainer": trainer},
              "disttrain_over_raw": ours / raw, "disttrain_over_trainer": ours / trainer}
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    table = "\n".join([
        f"# Overhead: {args.recipe} {' '.join(args.overrides)}, {args.nproc} processes, {args.steps} steps "
        f"({args.warmup} warm-up excluded)" + (" ; Trainer fed padded (unpacked) batches" if args.trainer_unpacked else ""),
        "",
        "| runner | tokens/s/device (non-padding) |", "|---|---|",
        f"| disttrain train.py (a) | {ours:,.0f} |", f"| raw PyTorch DDP loop (b) | {raw:,.0f} |",
        f"| transformers Trainer (c) | {trainer:,.0f} |", "",
        f"a/b = {ours / raw:.3f} (target >= 0.97), a/c = {ours / trainer:.3f} (target >= 1.2)"])
    (out / "overhead.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    with exit_on_user_error():
        main()

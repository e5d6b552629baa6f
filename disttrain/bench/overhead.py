"""`make bench-overhead`: disttrain's train.py vs a minimal PyTorch DDP loop vs transformers' Trainer.

Same recipe (model, data, micro-batch, accumulation), same number of processes, one invocation, run one
after the other; effective (non-padding) tokens/s per device after warm-up. Reports the ratios
disttrain/raw (overhead against the floor) and disttrain/Trainer. --rounds repeats the three runners (order
rotated each round) and reports the median of the per-round ratios with their range: on a shared machine
one round's ratio moves by 10-25 %. Writes <out>/overhead.json and .md.
--trainer-unpacked feeds the Trainer padded (unpacked) batches, its default, while train.py and the raw loop
use the recipe's data (e.g. data.packing=true): what a user gains by switching, in one measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from disttrain.bench.strategies import run_strategy, summarize
from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import launch_command, run_logged, why_failed


def run_peer(mode: str, recipe: str, nproc: int, steps: int, warmup: int, out: Path, overrides,
             timeout_s: float | None = None) -> float:
    result = out / f"{mode}.json"
    cmd = launch_command("ddp", nproc, "scripts/bench/peers.py", mode, *overrides, "--recipe", recipe,
                         "--steps", str(steps), "--warmup", str(warmup), "--result", str(result))
    proc = run_logged(cmd, out / f"{mode}.log", timeout_s)
    if proc.returncode != 0:
        raise DisttrainError(f"bench-overhead: {mode} failed ({why_failed(proc)}); log: {out / f'{mode}.log'}")
    return json.loads(result.read_text())["tokens_per_s_per_device"]


RUNNERS = ("disttrain", "raw_ddp", "hf_trainer")


def _one_round(args, out: Path, order: tuple[str, ...]) -> dict[str, float]:
    """Effective tokens/s per device of each runner, launched one after the other in `order`."""
    trainer_overrides = [*args.overrides, "data.packing=false"] if args.trainer_unpacked else args.overrides
    result = {}
    for runner in order:
        if runner == "disttrain":
            # train.py logs (one gather) every `warmup` steps, as a real run would, not every step
            records = run_strategy(args.recipe, "ddp", args.nproc, args.steps, out / "disttrain", args.overrides,
                                   log_every=args.warmup, timeout_s=args.timeout)
            result[runner] = summarize("ddp", records, args.warmup)["tokens_per_s_per_device"]
        elif runner == "raw_ddp":
            result[runner] = run_peer("raw", args.recipe, args.nproc, args.steps, args.warmup, out, args.overrides,
                                      args.timeout)
        else:
            result[runner] = run_peer("trainer", args.recipe, args.nproc, args.steps, args.warmup, out,
                                      trainer_overrides, args.timeout)
    return result


def round_order(i: int) -> tuple[str, ...]:
    """The runners of round i, rotated each round so that a slow phase of a shared machine does not always
    hit the same runner."""
    shift = i % len(RUNNERS)
    return RUNNERS[shift:] + RUNNERS[:shift]


def round_record(tokens: dict[str, float]) -> dict:
    return {"tokens_per_s_per_device": tokens, "disttrain_over_raw": tokens["disttrain"] / tokens["raw_ddp"],
            "disttrain_over_trainer": tokens["disttrain"] / tokens["hf_trainer"]}


def summarise(rounds: list[dict]) -> dict:
    """Medians over rounds: of each runner's tokens/s, and of the per-round ratios (a/b, a/c: the runners of
    one round saw the same machine, so ratios are taken within a round)."""
    a_b = [r["disttrain_over_raw"] for r in rounds]
    a_c = [r["disttrain_over_trainer"] for r in rounds]
    return {"tokens_per_s_per_device": {k: statistics.median(r["tokens_per_s_per_device"][k] for r in rounds)
                                        for k in RUNNERS},
            "a_b": a_b, "a_c": a_c,
            "disttrain_over_raw": statistics.median(a_b), "disttrain_over_trainer": statistics.median(a_c)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny/sft.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the three runners, the order rotated each round; ratios are per round")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (then it is killed)")
    parser.add_argument("--out", default="bench/overhead")
    parser.add_argument("--trainer-unpacked", action="store_true",
                        help="give the Trainer padded batches (data.packing=false), the others the recipe's data")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.steps % args.warmup:
        raise DisttrainError("--steps must be a multiple of --warmup (train.py logs once per warm-up length)")
    if args.rounds < 1:
        raise DisttrainError("--rounds must be at least 1")
    rounds = []
    for i in range(args.rounds):
        tokens = _one_round(args, out, round_order(i))
        rounds.append(round_record(tokens))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v:,.0f}" for k, v in tokens.items())
              + f" tokens/s/device; a/b {rounds[-1]['disttrain_over_raw']:.3f}, "
              f"a/c {rounds[-1]['disttrain_over_trainer']:.3f}", flush=True)
    summary = summarise(rounds)
    median, a_b, a_c = summary["tokens_per_s_per_device"], summary["a_b"], summary["a_c"]
    result = {"recipe": args.recipe, "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup,
              "overrides": args.overrides, "trainer_unpacked": args.trainer_unpacked, "rounds": rounds,
              "tokens_per_s_per_device": median,  # medians over rounds
              "disttrain_over_raw": summary["disttrain_over_raw"],
              "disttrain_over_trainer": summary["disttrain_over_trainer"]}
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    spread = (lambda v: f" (rounds: {min(v):.3f}-{max(v):.3f})") if args.rounds > 1 else (lambda v: "")
    table = "\n".join([
        f"# Overhead: {args.recipe} {' '.join(args.overrides)}, {args.nproc} processes, {args.steps} steps "
        f"({args.warmup} warm-up excluded), {args.rounds} round(s)"
        + (" ; Trainer fed padded (unpacked) batches" if args.trainer_unpacked else ""),
        "",
        "| runner | tokens/s/device (non-padding), median of rounds |", "|---|---|",
        f"| disttrain train.py (a) | {median['disttrain']:,.0f} |",
        f"| raw PyTorch DDP loop (b) | {median['raw_ddp']:,.0f} |",
        f"| transformers Trainer (c) | {median['hf_trainer']:,.0f} |", "",
        f"a/b = {result['disttrain_over_raw']:.3f}{spread(a_b)} (target >= 0.97), "
        f"a/c = {result['disttrain_over_trainer']:.3f}{spread(a_c)} (target >= 1.2); median of per-round ratios"])
    (out / "overhead.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    with exit_on_user_error():
        main()

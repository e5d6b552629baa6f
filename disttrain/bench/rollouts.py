"""`make bench-rollouts`: online RL's sampling under each strategy and rollout setting, in one run.

    python -m disttrain.bench.rollouts --recipe recipes/tiny/grpo.yaml --runs ddp,fsdp,zero3 --steps 40

Each run is a real `accelerate launch` of train.py logging every step, --repeats times, interleaved with the
other runs (the launch of median rollout time is kept); a run is a strategy, or strategy:generation_weights
(fsdp:per_layer: each layer gathered for every generated token, the path of a model too large to gather). Per
run: the summed rollout seconds (the slowest rank's, per step), that sum over the first run's (the ratio the
rollout work is judged by: one machine, one sitting), the sampling share of the step time, rollout tokens/s, peak
memory; and whether every logged step's rewards equal the first run's in every launch (the same completions:
sampling depends on each completion's seed alone). Writes <out>/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from disttrain.bench.strategies import run_strategy
from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import REPO

WEIGHTS = ("auto", "whole", "per_layer")


def parse_runs(text: str) -> list[tuple[str, str]]:
    """'ddp,fsdp,zero3:per_layer' -> [(strategy, generation_weights)]; unknown names in one line."""
    runs = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        strategy, _, weights = item.partition(":")
        weights = weights or "auto"
        if not (REPO / "accelerate_configs" / f"{strategy}.yaml").is_file():
            raise DisttrainError(f"bench-rollouts: no accelerate_configs/{strategy}.yaml (--runs {item})")
        if weights not in WEIGHTS:
            raise DisttrainError(f"bench-rollouts: --runs {item}: rl.generation_weights is one of {', '.join(WEIGHTS)}")
        runs.append((strategy, weights))
    if not runs:
        raise DisttrainError("bench-rollouts: --runs names no run (e.g. ddp,fsdp,zero3)")
    return runs


def summarize(name: str, records: list[dict]) -> dict:
    """One run's sums over its logged steps (every step logged: each record is one step)."""
    rolled = [r for r in records if "rollout_s" in r]
    if not rolled:
        raise DisttrainError(f"bench-rollouts: {name} logged no rollout (is its recipe training.objective: grpo?)")
    rollout_s = sum(r["rollout_s"] for r in rolled)
    step_s = sum(r["step_time_s"] for r in records)
    tokens = sum(r["rollout_tokens_per_s"] * r["rollout_s"] for r in rolled)
    return {"run": name, "steps": len(records), "rollout_s": rollout_s, "step_s": step_s,
            "sampling_share": rollout_s / step_s if step_s else 0.0,
            "rollout_tokens_per_s": tokens / rollout_s if rollout_s else 0.0,
            "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in records),
            "rewards": {r["step"]: r["reward"] for r in rolled}}


def median_of(launches: list[dict]) -> dict:
    """A run's launches as one row: the launch of median rollout time, every launch's rollout seconds beside it,
    and whether all launches logged the same rewards (sampling depends on the seeds alone)."""
    ordered = sorted(launches, key=lambda r: r["rollout_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["rollout_s_launches"] = [r["rollout_s"] for r in launches]
    row["repeatable"] = all(r["rewards"] == launches[0]["rewards"] for r in launches)
    return row


def compare(rows: list[dict]) -> None:
    """Each row's rollout time over the first row's, and whether its rewards equal the first's at every step."""
    base = rows[0]
    for row in rows:
        row["rollout_ratio"] = row["rollout_s"] / base["rollout_s"] if base["rollout_s"] else float("nan")
        row["rewards_equal"] = row["rewards"].keys() == base["rewards"].keys() and all(
            abs(row["rewards"][s] - v) <= 1e-6 * max(1.0, abs(v)) for s, v in base["rewards"].items())


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [f"# Rollouts: {meta['recipe']}", "",
             f"{meta['nproc']} processes, {meta['steps']} steps, {meta['device']}, torch {meta['torch']}", "",
             f"| run | rollout s (median) | launches | x {rows[0]['run']} | sampling share | rollout tokens/s | "
             f"peak mem (GB) | rewards = {rows[0]['run']}, every launch |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        launches = " / ".join(f"{v:.2f}" for v in r["rollout_s_launches"])
        lines.append(f"| {r['run']} | {r['rollout_s']:.2f} | {launches} | {r['rollout_ratio']:.2f} | "
                     f"{r['sampling_share']:.0%} | {r['rollout_tokens_per_s']:,.0f} | {r['peak_mem_gb']:.2f} | "
                     f"{'yes' if r['rewards_equal'] and r['repeatable'] else 'NO'} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny/grpo.yaml")
    parser.add_argument("--runs", default="ddp,fsdp,zero3", help="strategy[:generation_weights], comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each run, interleaved; the median "
                        "rollout time is kept (a 2-core machine's noise is ~30%% between two launches)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (then it is killed)")
    parser.add_argument("--out", default="bench/rollouts")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise DisttrainError(f"bench-rollouts: --steps ({args.steps}) must be at least 1")
    if args.repeats < 1:
        raise DisttrainError(f"bench-rollouts: --repeats ({args.repeats}) must be at least 1")
    out, runs = Path(args.out), parse_runs(args.runs)
    summaries: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):  # interleaved: a slow minute of the machine hits every run alike
        for strategy, weights in runs:
            name = strategy if weights == "auto" else f"{strategy}:{weights}"
            print(f"bench-rollouts: {name} ({repeat + 1}/{args.repeats}) ...", flush=True)
            folder = out / "runs" / f"{name.replace(':', '-')}-{repeat + 1}"
            records = run_strategy(args.recipe, strategy, args.nproc, args.steps, folder,
                                   [*args.overrides, f"rl.generation_weights={weights}"], timeout_s=args.timeout)
            summaries.setdefault(name, []).append(summarize(name, records))
    rows = [median_of(launches) for launches in summaries.values()]
    compare(rows)
    import torch

    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    meta = {"recipe": args.recipe, "steps": args.steps, "nproc": args.nproc, "device": device,
            "torch": torch.__version__, "overrides": args.overrides}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    write_markdown(out / "results.md", meta, rows)
    print(f"bench-rollouts: wrote {out / 'results.json'}, {out / 'results.md'}")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    with exit_on_user_error():
        main()

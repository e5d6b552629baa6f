"""`make bench`: the same recipe for a fixed number of steps under each strategy, one table.

    python -m disttrain.bench.strategies --recipe recipes/tiny/sft.yaml --strategies ddp,fsdp,zero2 --steps 30

Each strategy is a real `accelerate launch` of train.py with logging every step; the first --warmup steps
are left out of every average. Writes <out>/results.json (read by `make cost --bench`), results.md and
results.png. Throughput is non-padding tokens; MFU is against the device's dense peak \
(docs/outputs.md, "Logged metrics").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import REPO, launch_command, run_logged, why_failed
from disttrain.metrics.log import read_metrics
from disttrain.metrics.throughput import mfu_band

DEFAULT_STRATEGIES = "ddp,fsdp,zero1,zero2,zero3,zero3_offload"


def run_strategy(recipe: str, strategy: str, nproc: int, steps: int, run_dir: Path, overrides: list[str],
                 log_every: int = 1, timeout_s: float | None = None, launcher_args: tuple = (),
                 env: dict | None = None) -> list[dict]:
    """One launch; `log_every` > 1 measures with normal logging (windows must align with the warm-up);
    `launcher_args` go to `accelerate launch` (a mesh's sizes); `env` is added to the environment."""
    cmd = launch_command(
        strategy, nproc, "train.py", "--recipe", recipe, *overrides,
        f"training.max_steps={steps}", f"logging.every_steps={log_every}", "logging.report_to=[none]",
        "training.eval_every=null", "training.stop_at_step=null", f"output.dir={run_dir}", "output.resume=none",
        "output.checkpoint_every=null", "output.checkpoint_minutes=null", "output.checkpoint_at_end=false",
        "output.save_final_model=false",
        # what is measured ends with the last step: no samples, model card or plots after it (seconds per launch)
        "logging.samples=0", "output.report=false", launcher_args=launcher_args)
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = run_logged(cmd, run_dir / "launch.log", timeout_s, env)
    if proc.returncode != 0:
        raise DisttrainError(f"bench: {strategy} failed ({why_failed(proc)}); log: {run_dir / 'launch.log'}")
    return [r for r in read_metrics(run_dir) if "loss" in r]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(strategy: str, records: list[dict], warmup: int) -> dict:
    """Averages over the steps after warm-up: totals over time, not means of per-step rates."""
    # each record covers the steps since the previous one (one step when logging every step)
    for prev, r in zip([{"step": 0}] + records, records):
        r["window_s"] = r["step_time_s"] * (r["step"] - prev["step"])
    kept = [r for r in records if r["step"] > warmup]
    if not kept:
        raise DisttrainError(f"bench: {strategy}: no steps after {warmup} warm-up steps; raise --steps")
    seconds = sum(r["window_s"] for r in kept)
    devices = kept[0]["tokens_per_s"] / kept[0]["tokens_per_s_per_device"]
    tokens = sum(r["tokens"] for r in kept)
    flops = sum(r["tflops_per_device"] * r["window_s"] for r in kept)  # TFLOP per device
    step_times = [r["step_time_s"] for r in kept]
    return {
        "strategy": strategy,
        "steps": len(kept),
        "devices": round(devices),
        "tokens_per_s_per_device": tokens / seconds / devices,
        "tflops_per_device": flops / seconds,
        "mfu": flops / seconds / kept[0]["peak_tflops_per_device"],
        "peak_tflops_per_device": kept[0]["peak_tflops_per_device"],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in kept),
        "step_time_p50_s": statistics.median(step_times),
        "step_time_p90_s": _percentile(step_times, 0.9),
        "data_wait_share": sum(r["data_wait_share"] * r["window_s"] for r in kept) / seconds,
        "final_loss": kept[-1]["loss"],
        # hardware FLOPs utilisation (recomputed forward included), logged with gradient checkpointing
        **({"hfu": sum(r["hfu"] * r["window_s"] for r in kept) / seconds} if "hfu" in kept[0] else {}),
    }


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [f"# Benchmark: {meta['recipe']}", "",
             f"{meta['nproc']} processes, {meta['steps']} steps ({meta['warmup']} warm-up steps excluded), "
             f"{meta['device']}, torch {meta['torch']}", "",
             "| strategy | tokens/s/device | TFLOPS/device | MFU | peak mem (GB) | step p50 (s) | step p90 (s) | "
             "data wait |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['tokens_per_s_per_device']:,.0f} | {r['tflops_per_device']:.4g} | "
                     f"{r['mfu']:.1%} ({mfu_band(r['mfu'])}) | {r['peak_mem_gb']:.2f} | {r['step_time_p50_s']:.4f} | "
                     f"{r['step_time_p90_s']:.4f} | {r['data_wait_share']:.1%} |")
    lines += ["", f"MFU is measured against {rows[0]['peak_tflops_per_device']:.4g} TFLOP/s per device "
              f"({meta['peak_source']}). Bands: <15 % problem, 15-30 % normal, 30-45 % good, 45-55 % excellent, "
              ">55 % near the limit."]
    path.write_text("\n".join(lines) + "\n")


def write_chart(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r["strategy"] for r in rows]
    for ax, key, label in zip(axes, ("tokens_per_s_per_device", "mfu", "peak_mem_gb"),
                              ("tokens/s per device", "MFU", "peak memory (GB)")):
        ax.bar(names, [r[key] for r in rows], color="#4C72B0")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny/sft.yaml")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated accelerate config names")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (then it is killed)")
    parser.add_argument("--out", default="bench")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        raise DisttrainError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    out = Path(args.out)
    rows = []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        if not (REPO / "accelerate_configs" / f"{strategy}.yaml").is_file():
            raise DisttrainError(f"bench: no accelerate_configs/{strategy}.yaml")
        print(f"bench: {strategy} ...", flush=True)
        records = run_strategy(args.recipe, strategy, args.nproc, args.steps, out / "runs" / strategy, args.overrides,
                               timeout_s=args.timeout)
        rows.append(summarize(strategy, records, args.warmup))
        print(f"bench: {strategy}: {rows[-1]['tokens_per_s_per_device']:,.0f} tokens/s/device, "
              f"MFU {rows[-1]['mfu']:.1%}", flush=True)
    # one peak for the whole table (on CPUs each run times its own matmul; the first run's is used for all)
    common_peak = rows[0]["peak_tflops_per_device"]
    for r in rows:
        r["peak_tflops_per_device"], r["mfu"] = common_peak, r["tflops_per_device"] / common_peak
    import torch

    log = (out / "runs" / rows[0]["strategy"] / "launch.log").read_text()
    peak_source = next((line.split("(")[-1].rstrip(")") for line in log.splitlines() if "MFU against" in line), "?")
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    meta = {"recipe": args.recipe, "steps": args.steps, "warmup": args.warmup, "nproc": args.nproc,
            "device": device, "torch": torch.__version__, "peak_source": peak_source, "overrides": args.overrides}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    write_markdown(out / "results.md", meta, rows)
    write_chart(out / "results.png", rows, f"{Path(args.recipe).parent.name}/{Path(args.recipe).stem}: "
                f"{args.nproc} processes, {device}")
    print(f"bench: wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    with exit_on_user_error():
        main()

"""`make bench-distill`: the memory the distillation loss takes beside the SFT chunked loss, on the same rows.

Each engine runs in a fresh process (its peak resident memory is the process's own): rows of `--rows x --seq`
target tokens, a `--vocab`-wide head over `--hidden`-wide hidden states (the teacher's a little wider), the
loss and its backward. Reported: the peak resident memory above what the inputs hold, the median of
`--repeats` processes per engine, and the ratio distill / SFT (measured in one run, on one machine). glibc's
allocator is held to one arena (MALLOC_ARENA_MAX=1): with one per thread, freed chunks linger and the peak
says more about the allocator than about the loss. On a GPU the allocator's peak is what matters; this is the
CPU figure.

    make bench-distill                       # 152,064-token vocabulary, 4 x 1024 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ENGINES = ("sft", "distill")


def _one(args) -> None:
    """In the child: build the inputs, measure the loss's peak above them, print MiB."""
    import resource

    import torch

    from disttrain.objectives import distill
    from disttrain.objectives.token_loss import LogitTransform, chunked_loss_sum

    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.seq, args.hidden, requires_grad=True)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    labels = torch.randint(0, args.vocab, (args.rows, args.seq))
    teacher_hidden = torch.randn(args.rows, args.seq, args.hidden + 32)
    teacher_weight = torch.randn(args.vocab, args.hidden + 32)
    base = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if args.child == "sft":
        loss = chunked_loss_sum(hidden, head, labels)
    else:
        loss = distill.divergence_sum(hidden, head, teacher_hidden, (teacher_weight, None), labels, 0.5,
                                      (LogitTransform(), LogitTransform()), args.vocab, torch.zeros(2))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mib": (peak - base) / 2**20}))


def measure(args) -> dict:
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    result = {}
    for engine in ENGINES:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-m", "disttrain.bench.distill", "--child", engine,
                                  *(f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "rows", "seq"))],
                                 capture_output=True, text=True, env=env, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1])["mib"])
        result[engine] = {"runs_mib": runs, "median_mib": statistics.median(runs)}
    result["ratio"] = result["distill"]["median_mib"] / result["sft"]["median_mib"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/distill")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _one(args)
        return
    result = {"vocab": args.vocab, "hidden": args.hidden, "tokens": f"{args.rows} x {args.seq}", **measure(args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Distillation loss memory (CPU): vocabulary {args.vocab}, {args.rows} x {args.seq} target tokens", "",
             "Peak resident memory above the inputs, the loss and its backward, median of "
             f"{args.repeats} fresh processes per engine (`make bench-distill`).", "",
             "| engine | median (MiB) | runs (MiB) |", "|---|---|---|"]
    for engine in ENGINES:
        r = result[engine]
        lines.append(f"| {engine} | {r['median_mib']:.0f} | {', '.join(f'{v:.0f}' for v in r['runs_mib'])} |")
    lines += ["", f"distill / sft: {result['ratio']:.2f}x"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

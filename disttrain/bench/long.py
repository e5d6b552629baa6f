"""`make bench-long`: the memory a long sequence takes per rank, whole on every process vs cut by Ulysses (under
ZeRO-3) or by context parallelism (under FSDP2), or with every layer's matrices split by tensor parallelism.

    python -m disttrain.bench.long                                  # CPU defaults below
    python -m disttrain.bench.long --cp 1,2                         # context parallelism too
    python -m disttrain.bench.long --sp '' --tp 1,2                 # tensor parallelism (FSDP2 as size 1)
    python -m disttrain.bench.long --seq 32768 --hidden 4096 --layers 4 --sp 1,2,4 --cp 1,2,4 --nproc 4  # GPUs

A Llama-shaped model with a wide body and a small vocabulary (the layers' activations dominate, not the
logits) is made locally; rows of `--seq` tokens, all targets, no padding. For each size in `--sp` (1:
accelerate_configs/zero3.yaml, every process a whole sequence; S > 1: zero3_ulysses.yaml with S processes per
sequence), in `--cp` (1: fsdp.yaml; C > 1: fsdp_cp.yaml, C processes around the attention ring) and in `--tp`
(1: fsdp.yaml; T > 1: tp.yaml when T is every process, else fsdp_tp.yaml, groups of T sharing each sequence,
every matrix split over them) on `--nproc` processes, two launches of train.py:
- long:  rows of `--seq` tokens;
- floor: the same model, strategy and steps on rows of `--floor-seq` tokens: everything but the sequence.
Activations per rank = peak(long) - peak(floor); the expectation is ~1/S of size 1's (the same strategy without
the cut); under TP only attention's and the MLP's part falls (the cost planner's (10 + 24/T) of 34). On a CPU,
torch's ring attention needs the test-only CPU kernel mapping (tests/cpu_ring, put on PYTHONPATH for those
launches and said in the results): torch maps only its CUDA kernels. Peak memory per rank,
max over ranks: `torch.cuda.max_memory_allocated` on GPUs, peak RSS on CPUs (hence the floor, measured the
same way). Also the step time (median after warm-up) and tokens/s per device.
Writes <out>/results.json and results.md (default bench/long).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import yaml

from disttrain.bench.memory import build_model, build_text
from disttrain.bench.strategies import run_strategy, summarize
from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import cpu_ring_env


def recipe(model_dir: Path, data: Path, seq: int) -> dict:
    return {"model": {"name_or_path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"path": str(data), "format": "text", "concat_and_chunk": True, "max_seq_len": seq,
                     "shuffle": False},
            "training": {"micro_batch_size": 1, "grad_accum": 1, "lr": 1e-4, "mixed_precision": "no"},
            "logging": {"report_to": ["none"]}, "output": {"dir": "unused"}}


MESHES = {"sp": ("zero3", "zero3_ulysses"), "cp": ("fsdp", "fsdp_cp"), "tp": ("fsdp", "fsdp_tp")}  # size 1, > 1


def launch_args(mesh: str, size: int, nproc: int) -> tuple[str, list[str], dict]:
    """The accelerate config, launcher flags and environment of a sequence-parallel (sp), context-parallel (cp)
    or tensor-parallel (tp) size."""
    plain, cut = MESHES[mesh]
    if size == 1:
        return plain, [], {}
    if nproc % size:
        raise DisttrainError(f"bench-long: --{mesh} {size} must divide --nproc {nproc}")
    if mesh == "tp" and size == nproc:
        return "tp", ["--parallelism_config_tp_size", str(size)], {}
    import torch

    env = cpu_ring_env() if mesh == "cp" and not torch.cuda.is_available() else {}
    return cut, [f"--parallelism_config_{mesh}_size", str(size),
                 "--parallelism_config_dp_shard_size", str(nproc // size)], env


def measure(args) -> list[dict]:
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    body = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads}
    model_dir = build_model(out, args.vocab, args.seq, **body)
    text = build_text(out, args.seq, rows=args.steps * args.nproc)
    rows = []
    sizes = [(mesh, int(s)) for mesh in ("sp", "cp", "tp") for s in getattr(args, mesh).split(",") if s]
    for mesh, size in sizes:
        config, flags, env = launch_args(mesh, size, args.nproc)
        row = {"mesh": mesh, "size": size, "config": config, "processes": args.nproc,
               **({"cpu_ring_kernel": "tests/cpu_ring (test-only)"} if env else {})}
        for run, seq in (("long", args.seq), ("floor", args.floor_seq)):
            path = out / f"{mesh}{size}_{run}.yaml"
            path.write_text(yaml.safe_dump(recipe(model_dir, text, seq)))
            records = run_strategy(str(path), config, args.nproc, args.steps, out / f"{mesh}{size}_{run}", [],
                                   timeout_s=args.timeout, launcher_args=tuple(flags), env=env)
            summary = summarize(config, records, args.warmup)
            row[f"{run}_peak_gb"] = summary["peak_mem_gb"]
            if run == "long":
                row["step_s"] = summary["step_time_p50_s"]
                row["tokens_per_s_per_device"] = summary["tokens_per_s_per_device"]
        row["activations_gb"] = row["long_peak_gb"] - row["floor_peak_gb"]
        rows.append(row)
        write(out, args, rows)  # after every size: a cut run keeps what finished
    return rows


def write(out: Path, args, rows: list[dict]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    memory = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS (ru_maxrss)"
    meta = {"seq": args.seq, "floor_seq": args.floor_seq, "hidden": args.hidden, "layers": args.layers,
            "heads": args.heads, "vocab": args.vocab, "steps": args.steps, "warmup": args.warmup,
            "processes": args.nproc, "device": device, "torch": torch.__version__, "memory": memory}
    bases = {r["mesh"]: r for r in rows if r["size"] == 1}
    for r in rows:
        base = bases.get(r["mesh"])
        if base is not None:  # against the same strategy without the cut
            r["activations_vs_size1"] = r["activations_gb"] / base["activations_gb"]
            r["step_time_vs_size1"] = r["step_s"] / base["step_s"]
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Long sequences: {args.seq} tokens, hidden {args.hidden} x {args.layers} layers, "
             f"{args.nproc} processes", "",
             f"{device}, torch {meta['torch']}; peak memory per rank = {memory}, max over ranks; activations = "
             f"peak - floor (the same run on {args.floor_seq}-token rows); step time = median after "
             f"{args.warmup} warm-up steps; 'vs size 1' = against the same strategy without the cut", "",
             "| mesh | size | config | peak (GB) | floor (GB) | activations (GB) | vs size 1 | step time (s) | "
             "vs size 1 | tokens/s per device |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def ratio(key):
            return format(r[key], ".2f") if key in r else "-"
        lines.append(f"| {r['mesh']} | {r['size']} | {r['config']} | {r['long_peak_gb']:.2f} | "
                     f"{r['floor_peak_gb']:.2f} | {r['activations_gb']:.2f} | {ratio('activations_vs_size1')} | "
                     f"{r['step_s']:.2f} | {ratio('step_time_vs_size1')} | {r['tokens_per_s_per_device']:.0f} |")
    if any("cpu_ring_kernel" in r for r in rows):
        lines += ["", "cp > 1 on a CPU: torch's ring attention with the test-only mapping of its CPU attention kernel "
                  "(tests/cpu_ring); torch maps only CUDA kernels"]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", default="1,2", help="Ulysses sizes under ZeRO-3; 1 = plain ZeRO-3 (the reference)")
    parser.add_argument("--cp", default="", help="context-parallel sizes under FSDP2; 1 = plain FSDP2 (the reference)")
    parser.add_argument("--tp", default="", help="tensor-parallel sizes (alone when = --nproc, else under FSDP2); "
                                                 "1 = plain FSDP2 (the reference)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--floor-seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--out", default="bench/long")
    args = parser.parse_args(argv)
    measure(args)
    print((Path(args.out) / "results.md").read_text())
    sys.stdout.flush()


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

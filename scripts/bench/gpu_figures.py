"""The GPU table of docs/benchmarks.md in one run: a ~0.84B Llama-shape full fine-tune (hidden 2048, 16
layers, GQA 32/4 heads, vocab 32000), bf16 autocast over fp32 master weights, packed sequences of 2048,
with and without torch.compile and gradient checkpointing, on one GPU, FSDP2 (1 process) and ZeRO-2
(1 process). Each configuration is a real `accelerate launch` of train.py through disttrain.bench.strategies; one that
fails is recorded as failed (its log kept) and the others still run.

    python3 scripts/bench/gpu_figures.py --out $OUT     # on the GPU machine (estimated 6-8 minutes; not yet run there)
    python3 scripts/bench/gpu_figures.py --shape tiny --seq 64 --steps 4 --warmup 1 --precision no \\
        --configs single,fsdp --out /tmp/gpu_dry_run                # CPU dry run (tests/test_bench.py)

The model (random init from a config, nothing downloaded) and a synthetic text corpus are made locally.
Writes <out>/gpu_figures.json, gpu_figures.md and launches.log (every launch's output, one after the other).
It needs disttrain's dependencies on the GPU machine (deepspeed and datasets included); without deepspeed
the ZeRO-2 row fails and the others run. Each launch is killed after --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import yaml  # noqa: E402

from disttrain.bench.strategies import run_strategy, summarize  # noqa: E402
from disttrain.errors import DisttrainError  # noqa: E402
from disttrain.metrics.throughput import mfu_band  # noqa: E402
from disttrain.tools.tiny import WORDS, build_tokenizer, tiny_llama_config  # noqa: E402

SHAPES = {
    "0.84b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=4, max_position_embeddings=4096, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
}
# name -> (accelerate config, torch.compile, gradient checkpointing)
CONFIGS = {
    "single": ("single_gpu", False, False),
    "single_compile": ("single_gpu", True, False),
    "single_ckpt": ("single_gpu", False, True),
    "single_compile_ckpt": ("single_gpu", True, True),
    "fsdp": ("fsdp", False, False),
    "fsdp_compile": ("fsdp", True, False),
    "zero2": ("zero2", False, False),
}


def build_model(shape: str, out: Path) -> int:
    """Tokenizer + randomly initialised model in `out`; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    dims = {"vocab_size": len(tokenizer), **SHAPES[shape]}  # a vocabulary larger than the tokenizer's is fine
    config = tiny_llama_config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=None, **dims)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # loaded as fp32 master weights
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def write_corpus(path: Path, tokens_needed: int, seq: int) -> Path:
    """Rows of random words (one or more tokens each) shorter than a sequence, so that packing fills every
    sequence from several rows (a longer row would be truncated, not split); enough for every step."""
    rng = random.Random(0)
    rows, words = [], 0
    while words < tokens_needed * 1.5:
        n = rng.randint(max(1, seq // 8), max(2, seq // 2))
        rows.append(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(n))}))
        words += n
    path.write_text("\n".join(rows) + "\n")
    return path


def recipe(args, model_dir: Path, data: Path) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"path": str(data), "format": "text", "max_seq_len": args.seq, "packing": True},
        "training": {"max_steps": args.steps, "micro_batch_size": args.micro_batch, "grad_accum": 1, "lr": 1e-5,
                     "lr_scheduler": "constant", "mixed_precision": args.precision, "eval_every": None},
        "logging": {"report_to": ["none"], "every_steps": 1},
        "output": {"dir": str(args.work / "unused")},
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# GPU figures: {meta['shape']} Llama shape ({meta['params']}), seq {meta['seq']}, micro-batch "
             f"{meta['micro_batch']}, {meta['precision']}, {meta['steps']} steps ({meta['warmup']} warm-up excluded)",
             "", f"{meta['device']}, torch {meta['torch']}", "",
             "| config | compile | grad ckpt | tokens/s/device | TFLOPS/device | MFU | HFU | peak mem (GB) | "
             "step p50 (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['config']} | {'yes' if r['compile'] else 'no'} | {'yes' if r['grad_ckpt'] else 'no'} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | | |")
            continue
        hfu = f"{r['hfu']:.1%}" if "hfu" in r else "-"
        lines.append(f"{head} {r['tokens_per_s_per_device']:,.0f} | {r['tflops_per_device']:.3g} | "
                     f"{r['mfu']:.1%} ({mfu_band(r['mfu'])}) | {hfu} | {r['peak_mem_gb']:.1f} | "
                     f"{r['step_time_p50_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="gpu_figures.json/.md and launches.log go here")
    parser.add_argument("--work", type=Path, default=Path("/tmp/disttrain_gpu_figures"),
                        help="model, corpus and run dirs (GBs; kept out of --out)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.84b")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch before it is killed")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}")
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (train.py logs once per warm-up length)")
    marker = args.work / ".disttrain_gpu_figures"
    if args.work.exists() and any(args.work.iterdir()) and not marker.exists():
        parser.error(f"--work {args.work} holds other files; give an empty or new directory (it is wiped)")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.touch()
    model_dir = work / "model"
    params = build_model(args.shape, model_dir)
    data = write_corpus(work / "corpus.jsonl", args.steps * args.micro_batch * args.seq, args.seq)
    recipe_path = work / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(args, model_dir, data), sort_keys=False))
    meta = {"shape": args.shape,
            "params": f"{params / 1e9:.2f}B parameters" if params > 1e8 else f"{params / 1e6:.2f}M parameters",
            "seq": args.seq,
            "micro_batch": args.micro_batch, "precision": args.precision, "steps": args.steps,
            "warmup": args.warmup, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"}
    rows = []
    for name in names:
        config, compiled, ckpt = CONFIGS[name]
        overrides = [f"training.compile={str(compiled).lower()}", f"model.gradient_checkpointing={str(ckpt).lower()}"]
        row = {"config": name, "accelerate_config": config, "compile": compiled, "grad_ckpt": ckpt}
        try:  # logging once per warm-up length, as a real run would: a log line gathers and syncs
            records = run_strategy(str(recipe_path), config, 1, args.steps, work / name, overrides,
                                   log_every=args.warmup, timeout_s=args.timeout)
            row.update(summarize(name, records, args.warmup))
        except DisttrainError as exc:
            row["error"] = str(exc).split(";")[0]
        except Exception as exc:  # one broken configuration must not cost the others their device minutes
            row["error"] = f"{type(exc).__name__}: {exc}"
        launch_log = work / name / "launch.log"
        with (args.out / "launches.log").open("a") as log:  # one file: the device returns at most 8
            log.write(f"\n===== {name}: {' '.join(overrides)}\n")
            log.write(launch_log.read_text() if launch_log.exists() else "(no log)\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
        # rewritten after every configuration: a run cut short still leaves the rows measured so far
        (args.out / "gpu_figures.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.out / "gpu_figures.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

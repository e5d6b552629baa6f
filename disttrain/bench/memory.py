"""`make bench-memory`: how much memory the loss takes, plain (full logits) vs chunked vs TRL's fused head, per
strategy.

    python -m disttrain.bench.memory                                   # CPU defaults below
    python -m disttrain.bench.memory --strategies single_gpu,fsdp --vocab 151936 --seq 4096 --nproc 8
    python -m disttrain.bench.memory --engines plain,chunked         # without TRL's engine

A Llama-shaped model with a large vocabulary (default 151,936, Qwen2.5's) and a small body (hidden 64,
2 layers), so the loss dominates, is made locally. For each strategy, one launch of train.py per engine
(`--engines`) and a floor:
- plain:   training.loss_impl=plain, rows of `--seq` tokens that are all targets;
- chunked: training.loss_impl=chunked, the same rows;
- trl:     training.loss_impl=trl (TRL's fused LM head), the same rows;
- floor:   chunked on rows of the same length with one target each (the loss sees one token): everything
           the step holds except the loss.
The loss's share of peak memory = peak - floor; the reduction = plain share / the engine's share. Peak
memory per rank, max over ranks: `torch.cuda.max_memory_allocated` on GPUs; on CPUs the process's peak RSS
(ru_maxrss), which also holds what the allocator caches — hence the floor run, measured the same way.
Step time: median after warm-up, engine / plain as a ratio from the same invocation. The engines train the
same model on the same rows, so their logged losses must agree: the largest relative difference from
plain's, over every logged step, is reported too.
Writes <out>/results.json and results.md (default bench/memory).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import yaml

from disttrain.bench.strategies import run_strategy, summarize
from disttrain.errors import DisttrainError, exit_on_user_error

ENGINES = ("plain", "chunked", "trl")  # training.loss_impl values; plain is the reference


def build_model(out: Path, vocab: int, seq: int, **body) -> Path:
    """A Llama-shaped model of `vocab` tokens (tools.tiny's small body, or `body`'s dimensions) and the tiny
    tokenizer, written to out/model."""
    import torch
    from transformers import AutoModelForCausalLM

    from disttrain.tools.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    config = tiny_llama_config(vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                               max_position_embeddings=max(seq, 1024), **body)
    torch.manual_seed(0)
    model_dir = out / "model"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def build_text(out: Path, seq: int, rows: int) -> Path:
    """An all-targets text corpus of at least `rows` rows of `seq` tokens (with data.concat_and_chunk)."""
    from disttrain.tools.tiny import WORDS

    words = [WORDS[i % len(WORDS)] for i in range(seq * rows * 2)]
    text = out / "all_targets.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(words[i:i + 50])}) + "\n"
                            for i in range(0, len(words), 50)))
    return text


def build(out: Path, vocab: int, seq: int, rows: int) -> tuple[Path, Path, Path]:
    """Model dir, an all-targets text corpus and a one-target chat corpus, both of `seq`-token rows."""
    from disttrain.tools.tiny import WORDS, build_tokenizer

    model_dir, text = build_model(out, vocab, seq), build_text(out, seq, rows)
    tokenizer = build_tokenizer()
    prompt = []
    for i in range(seq * rows * 2):  # a user turn that fills the row but for a one-word answer
        prompt.append(WORDS[i % len(WORDS)])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(prompt)}], tokenize=False,
                                                 add_generation_prompt=True)
        if len(tokenizer(rendered)["input_ids"]) >= seq - 8:
            break
    chat = out / "one_target.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": " ".join(prompt)},
                                                      {"role": "assistant", "content": "ok"}]}) + "\n"
                            for _ in range(rows)))
    return model_dir, text, chat


def recipe(model_dir: Path, data: Path, fmt: str, seq: int, impl: str) -> dict:
    data_section = {"path": str(data), "format": fmt, "max_seq_len": seq, "shuffle": False}
    if fmt == "text":
        data_section["concat_and_chunk"] = True
    return {"model": {"name_or_path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": data_section,
            "training": {"micro_batch_size": 1, "grad_accum": 1, "lr": 1e-4, "mixed_precision": "no",
                         "loss_impl": impl},
            "logging": {"report_to": ["none"]}, "output": {"dir": "unused"}}


def measure(args) -> list[dict]:
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir, text, chat = build(out, args.vocab, args.seq, rows=args.steps * args.nproc * 2)
    engines = args.engines.split(",")
    if engines[0] != "plain" or not set(engines) <= set(ENGINES):
        raise DisttrainError(f"bench-memory: --engines {args.engines}: plain first (the reference), then any of "
                             f"{', '.join(ENGINES[1:])}")
    rows = []
    for strategy in args.strategies.split(","):
        nproc = 1 if strategy.startswith("single") else args.nproc
        result = {"strategy": strategy, "processes": nproc, "engines": engines}
        losses = {}
        for run in (*engines, "floor"):
            data, fmt = (chat, "chat") if run == "floor" else (text, "text")
            path = out / f"{strategy}_{run}.yaml"
            path.write_text(yaml.safe_dump(recipe(model_dir, data, fmt, args.seq, "chunked" if run == "floor" else
                                                  run)))
            records = run_strategy(str(path), strategy, nproc, args.steps, out / f"{strategy}_{run}", [],
                                   timeout_s=args.timeout)
            summary = summarize(strategy, records, args.warmup)
            result[f"{run}_peak_gb"] = summary["peak_mem_gb"]
            result[f"{run}_step_s"] = summary["step_time_p50_s"]
            losses[run] = [r["loss"] for r in records]
        plain = result["plain_peak_gb"] - result["floor_peak_gb"]
        for engine in engines:
            share = result[f"{engine}_peak_gb"] - result["floor_peak_gb"]
            result[f"{engine}_loss_gb"] = share
            if engine != "plain":
                result[f"{engine}_reduction"] = plain / share if share > 0 else float("inf")
                result[f"{engine}_step_time_ratio"] = result[f"{engine}_step_s"] / result["plain_step_s"]
                result[f"{engine}_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in
                                                        zip(losses[engine], losses["plain"], strict=True))
        rows.append(result)
        write(out, args, rows)  # after every strategy: a cut run keeps what finished
    return rows


def write(out: Path, args, rows: list[dict]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    meta = {"vocab": args.vocab, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "device": device,
            "torch": torch.__version__,
            "memory": "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS (ru_maxrss)"}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Loss memory: vocab {args.vocab:,}, sequence {args.seq}, micro-batch 1", "",
             f"{device}, torch {meta['torch']}; peak memory per rank = {meta['memory']}, max over ranks; "
             f"loss share = peak - floor (the same step with one target token); step time = median after "
             f"{args.warmup} warm-up steps; loss diff = largest relative difference from plain's logged loss", "",
             "| strategy | engine | peak (GB) | floor (GB) | loss share (GB) | reduction vs plain | step time (s) "
             "| step time / plain | loss diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for engine in r["engines"]:
            reference = engine == "plain"
            lines.append(f"| {r['strategy']} | {engine} | {r[f'{engine}_peak_gb']:.2f} | {r['floor_peak_gb']:.2f} | "
                         f"{r[f'{engine}_loss_gb']:.2f} | "
                         f"{'-' if reference else format(r[f'{engine}_reduction'], '.1f') + 'x'} | "
                         f"{r[f'{engine}_step_s']:.3f} | "
                         f"{'-' if reference else format(r[f'{engine}_step_time_ratio'], '.2f')} | "
                         f"{'-' if reference else format(r[f'{engine}_loss_rel_diff'], '.1e')} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="single_gpu,ddp,fsdp,zero3",
                        help="accelerate configs (single_gpu runs one process)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="training.loss_impl values to compare, plain (the reference) first")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--out", default="bench/memory")
    args = parser.parse_args(argv)
    measure(args)
    print((Path(args.out) / "results.md").read_text())
    sys.stdout.flush()


if __name__ == "__main__":
    with exit_on_user_error():
        main()

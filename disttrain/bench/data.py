"""`make bench-data`: how fast and how lean data preparation is, against the tokenizer's own floor.

    python -m disttrain.bench.data                                # 200k alpaca + 50k chat + 50k text rows
    python -m disttrain.bench.data --alpaca 20000 --chat 5000 --text 5000 --no-launch    # a quick look

Generated records (not timed) go through disttrain's whole pipeline from a cold `datasets` cache: read,
render (chat template), tokenise, mask, drop, report (`build_datasets`, `data.num_proc` at its default). In
the same run, the floor: one batched fast-tokenizer pass (`datasets.map(batched=True)`, one process) over the
same rendered text, also from a cold cache. Every measurement is a fresh interpreter with its own cache dir;
peak memory is its peak RSS. Memory against size: the alpaca pipeline at a quarter and at the full size,
and the line-by-line scan that names a bad record (`validate_local_file`) on the same two files. Then the
time to the first optimizer step of a 2-process DDP launch on the alpaca data (cold cache), and which ranks
tokenised (data_report.json: only rank 0 should). The tokenizer is the tiny model's byte-level BPE.
Writes <out>/results.json and results.md (default bench/data).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import REPO, launch_command, run_logged, why_failed

TOKENIZER = REPO / "artifacts" / "tiny-llama"
WORDS = ("apple river stone tiger paper garden table violet ocean music planet silver green cloud bridge "
         "rocket candle forest winter mountain").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def _record(fmt: str, rng: random.Random) -> dict:
    if fmt == "alpaca":
        return {"instruction": "Sort the words: " + _words(rng, 8), "input": _words(rng, 20),
                "output": _words(rng, 40)}
    if fmt == "chat":  # three user/assistant turns after a system prompt
        messages = [{"role": "system", "content": "You are a careful assistant."}]
        for _ in range(3):
            messages += [{"role": "user", "content": _words(rng, 15)},
                         {"role": "assistant", "content": _words(rng, 30)}]
        return {"messages": messages}
    return {"text": _words(rng, 200)}


def generate(folder: Path, fmt: str, rows: int, seed: int = 0) -> Path:
    path = folder / f"{fmt}_{rows}.jsonl"
    if not path.exists():
        rng = random.Random(seed)
        with path.open("w") as f:
            for _ in range(rows):
                f.write(json.dumps(_record(fmt, rng)) + "\n")
    return path


def render_for_floor(path: Path, fmt: str) -> Path:
    """The text the model sees for every record (the chat template's rendering, EOS after a document)."""
    from transformers import AutoTokenizer

    from disttrain.recipe.schema import SourceSection
    from disttrain.data.formats import to_example

    out = path.with_suffix(".rendered.jsonl")
    if out.exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    source = SourceSection(path=str(path), format=fmt)
    with path.open() as records, out.open("w") as rendered:
        for line in records:
            example = to_example(json.loads(line), source)
            text = example + tokenizer.eos_token if isinstance(example, str) else \
                tokenizer.apply_chat_template(example.messages, tokenize=False)
            rendered.write(json.dumps({"text": text}) + "\n")
    return out


# ---- measurements, each in a fresh interpreter (python -m disttrain.bench.data --child KIND FILE FORMAT) ----

class _PeakAnon:
    """Peak anonymous resident memory of this process (heap, not the memory-mapped Arrow files that peak RSS
    also counts), sampled every 20 ms from /proc/self/status; None where there is no /proc."""

    def __init__(self):
        import threading

        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if os.path.exists("/proc/self/status"):
            self._thread.start()

    def _read(self):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))

    def _sample(self):
        while not self._stop.wait(0.02):
            self._read()

    def stop(self) -> float | None:
        if not self._thread.is_alive():
            return None
        self._stop.set()
        self._read()  # a measurement shorter than one sampling period still gets a value
        return self.peak_kb / 2**20


def _child(kind: str, path: str, fmt: str, max_seq_len: int) -> dict:
    from contextlib import nullcontext

    import datasets  # imported before the clock starts, for ours and the floor alike
    from transformers import AutoTokenizer

    from disttrain.recipe.schema import DataSection

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    section = DataSection(path=path, format=fmt, max_seq_len=max_seq_len)
    anon = _PeakAnon()
    started = time.perf_counter()
    if kind == "ours":
        from disttrain.data import build_datasets
        from disttrain.data.pipeline import workers

        rows, _, reports = build_datasets(section, tokenizer, 0, nullcontext)
        result = {"records": reports["train"].examples, "num_proc": workers(section, reports["train"].examples) or 1}
    elif kind == "floor":
        table = datasets.load_dataset("json", data_files={"train": path}, split="train")
        rows = table.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
        result = {"records": len(rows), "num_proc": 1}
    else:  # the scan that names a bad record as file:line
        from disttrain.data import validate_local_file

        result = {"records": validate_local_file(path, section.all_sources()[0]), "num_proc": 1}
    seconds = time.perf_counter() - started
    return {**result, "seconds": seconds, "records_per_s": result["records"] / seconds,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_anon_gb": anon.stop(),
            "workers_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}


def measure(kind: str, path: Path, fmt: str, cache: Path, max_seq_len: int) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "disttrain.bench.data", "--child", kind, str(path), fmt,
                           "--max-seq-len", str(max_seq_len)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise DisttrainError(f"bench-data: {kind} on {path.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_step(path: Path, work: Path, max_seq_len: int) -> dict:
    """A 2-process DDP launch with a cold cache: seconds from launch to the first optimizer step's log line,
    and each rank's preparation (data_report.json)."""
    recipe = work / "recipe.yaml"
    recipe.write_text(json.dumps({
        "model": {"name_or_path": str(TOKENIZER), "dtype": "float32"},
        "data": {"path": str(path), "format": "alpaca", "max_seq_len": max_seq_len},
        "training": {"max_steps": 1, "micro_batch_size": 4, "mixed_precision": "no"},
        "logging": {"report_to": ["none"], "every_steps": 1, "samples": 0},  # measured: up to the first step
        "output": {"dir": str(work / "run"), "resume": "none", "checkpoint_at_end": False,
                   "save_final_model": False, "report": False}}))
    cmd = launch_command("ddp", 2, "train.py", "--recipe", str(recipe))
    started = time.time()
    proc = run_logged(cmd, work / "launch.log", timeout_s=1800, env={"HF_DATASETS_CACHE": str(work / "cache")})
    if proc.returncode != 0:
        raise DisttrainError(f"bench-data: the DDP launch failed ({why_failed(proc)}); log: {work / 'launch.log'}")
    from disttrain.metrics.log import read_metrics

    first = next(r for r in read_metrics(work / "run") if "loss" in r)
    report = json.loads((work / "run" / "data_report.json").read_text())
    return {"seconds_to_first_step": first["time"] - started,
            "preparation_per_rank": report["preparation_per_rank"]}


def write_markdown(path: Path, results: dict) -> None:
    lines = [f"# bench-data ({results['host']})", "",
             "| data | records | ours (s) | ours rec/s | num_proc | floor (s) | ours / floor | peak RSS ours (GB) |",
             "|---|---|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        lines.append(f"| {fmt} | {r['ours']['records']} | {r['ours']['seconds']:.1f} | "
                     f"{r['ours']['records_per_s']:,.0f} | {r['ours']['num_proc']} | {r['floor']['seconds']:.1f} | "
                     f"{r['ratio']:.2f} | {r['ours']['peak_rss_gb']:.2f} |")
    memory = results.get("memory")
    if memory:
        lines += ["", "| memory vs size (alpaca), main process | 1/4 size | full size | ratio |", "|---|---|---|---|"]
        for kind, (small, full) in memory.items():
            for key, what in (("peak_rss_gb", "peak RSS"), ("peak_anon_gb", "peak anonymous RSS (heap)")):
                if small.get(key) and full.get(key):
                    lines.append(f"| {kind}: {what} (GB) | {small[key]:.2f} | {full[key]:.2f} | "
                                 f"{full[key] / small[key]:.2f} |")
    launch = results.get("launch")
    if launch:
        ranks = ", ".join(f"rank {r['rank']}: {r['prepare_s']:.1f} s "
                          f"({'tokenised' if r['tokenised_here'] else 'cache'})"
                          for r in launch["preparation_per_rank"])
        lines += ["", f"2-process DDP, cold cache: first optimizer step after {launch['seconds_to_first_step']:.1f} s"
                      f" ({ranks})"]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpaca", type=int, default=200_000)
    parser.add_argument("--chat", type=int, default=50_000)
    parser.add_argument("--text", type=int, default=50_000)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--no-launch", action="store_true", help="skip the 2-process time-to-first-step launch")
    parser.add_argument("--out", default="bench/data")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "FILE", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, args.max_seq_len)))
        return
    if not (TOKENIZER / "tokenizer.json").is_file():
        raise DisttrainError(f"bench-data: {TOKENIZER} is missing; run `make tiny` first")
    out = Path(args.out)
    work = out / "work"
    (work / "data").mkdir(parents=True, exist_ok=True)
    results = {"host": f"{platform.node()}, {os.cpu_count()} CPUs", "formats": {}}
    run = 0

    def cold(kind, path, fmt):
        nonlocal run
        run += 1
        return measure(kind, path, fmt, work / f"cache-{run}", args.max_seq_len)

    for fmt, rows in (("alpaca", args.alpaca), ("chat", args.chat), ("text", args.text)):
        if rows <= 0:
            continue
        path = generate(work / "data", fmt, rows)
        ours, floor = cold("ours", path, fmt), cold("floor", render_for_floor(path, fmt), "text")
        results["formats"][fmt] = {"ours": ours, "floor": floor, "ratio": ours["seconds"] / floor["seconds"]}
        print(f"bench-data: {fmt}: {rows} records, ours {ours['seconds']:.1f} s, floor {floor['seconds']:.1f} s "
              f"-> {results['formats'][fmt]['ratio']:.2f}x", flush=True)
    if args.alpaca >= 4:  # (the full-size pipeline run is the one above)
        small, full = (generate(work / "data", "alpaca", args.alpaca // 4),
                       generate(work / "data", "alpaca", args.alpaca))
        results["memory"] = {"ours": [cold("ours", small, "alpaca"), results["formats"]["alpaca"]["ours"]],
                             "validate": [cold("validate", small, "alpaca"), cold("validate", full, "alpaca")]}
        print("bench-data: memory vs size measured", flush=True)
    if not args.no_launch and args.alpaca:
        results["launch"] = first_step(generate(work / "data", "alpaca", args.alpaca), work, args.max_seq_len)
        print(f"bench-data: DDP first step after {results['launch']['seconds_to_first_step']:.1f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_markdown(out / "results.md", results)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    with exit_on_user_error():
        main()

"""The GPU acceptance run: every claim of disttrain that only a GPU can check, in one command, one
PASS / FAIL / SKIP / INFO line per item. Prepared on CPU; not yet run on a GPU.

Layout: this file is the runner (the item list, --items/--timeout/--budget/--jobs, the results); harness.py
is what every item uses (settings, context, launches with deadlines, the base recipe, loss and export
checks); items/ holds one module per family (finetune, adapters, dpo, rl, moe, packing, measure); kit_install.py
installs the wheels of `make gpu-kit` (kit.py) on the GPU machine.

    make gpu-kit    # here: gpu_kit/, the wheels the GPU machine lacks (scripts/gpu/kit.py), ~9 MiB
    # on the GPU machine (one H200; torch, accelerate, transformers, peft preinstalled), from the repo root,
    # carrying gpu_kit:
    python3 scripts/gpu/acceptance.py --out $OUT --wheels gpu_kit
    # CPU dry run (tests/test_gpu_acceptance.py runs a subset): tiny model, 4 steps, fp32, the CPU items
    python3 scripts/gpu/acceptance.py --dry-run --out /tmp/acceptance

Items (--items a,b,c picks some; default all, started in the order below):

    doctor_nccl               `python -m disttrain.tools.doctor --nproc 1 --json` exits 0; NCCL / GPU lines recorded
    full_bf16_{single,fsdp,zero2,zero3}
                              bf16 full fine-tune, world size 1: an uninterrupted run of N steps, and a new
                              launch resumed from its step-N/2 checkpoint (it must say so): per-step losses
                              equal (rel 1e-3 on GPU), final/ loads with AutoModelForCausalLM.from_pretrained;
                              ZeRO: final/ equals its last checkpoint read back (the fp32 masters), bit for bit;
                              FSDP2 and ZeRO-3: the end-of-run samples gathered the model whole once
    hsdp_2x2                  the same on 4 GPUs under accelerate_configs/hsdp.yaml (2 replicas x 2 shards);
                              SKIP on a machine with fewer GPUs (the one lent GPU: prepared, not run)
    ulysses_sp2               the same on 2 GPUs under accelerate_configs/zero3_ulysses.yaml (each sequence split
                              over both: DeepSpeed's all-to-all attention on NCCL, sdpa); SKIP below 2 GPUs
    tensor_parallel_tp2       the same on 2 GPUs under accelerate_configs/tp.yaml (every weight matrix split over
                              both, activations all-reduced over NCCL; DCP checkpoint); SKIP below 2 GPUs
    fsdp_tp_2x2               the same on 4 GPUs under accelerate_configs/fsdp_tp.yaml (2 groups of tp 2, FSDP2
                              over them, bf16 all-gathers: transformers' 2-D layout on NCCL); SKIP below 4 GPUs
    pipeline_pp2              the same on 2 GPUs under accelerate_configs/fsdp_pp.yaml (the layers cut into 2 stages,
                              1F1B over NCCL's point-to-point sends; DCP checkpoint, sharded export); SKIP below 2
                              GPUs
    lora_{ddp,fsdp}           LoRA trains, every logged loss finite, the adapter is exported
    lora_tp2                  the same on 2 GPUs under accelerate_configs/tp.yaml (split adapters on NCCL); SKIP below
                              2 GPUs
    qlora_{ddp,fsdp}          the same with model.quantization=4bit; qlora_fsdp sets DISTTRAIN_ALLOW_UNVERIFIED=1
                              (this run is what verifies it); SKIP when bitsandbytes does not import
    adamw_8bit                training.optimizer=adamw_8bit on one GPU; SKIP without bitsandbytes
    vlm_{fsdp,zero3}          the tiny Gemma-3-shaped vision-language model on the shipped pictures in bf16 under
                              FSDP2 / ZeRO-3: finite losses, eval loss falls, final/ loads with
                              AutoModelForImageTextToText and AutoProcessor, a sample generated on an image
    moe_lora                  a small Qwen3-MoE (8 experts, 2 per token): LoRA on attention and the fused experts
                              (lora.target_parameters), router loss on, bf16 under FSDP2 with transformers' GPU
                              expert kernels: finite losses, expert adapters exported, MFU in (0, 1]
    moe_ep2                   the same Qwen3-MoE, full fine-tuning in bf16 with the router loss, under
                              accelerate_configs/fsdp_ep.yaml on 2 GPUs (4 experts whole on each, tokens sent by
                              all-to-all on NCCL) and under fsdp.yaml: finite losses, the first loss equal (1e-2),
                              tokens/s of both; expected EP / FSDP2 0.7-1.3 for this small model, stated before
                              any run (recorded, not failed, outside it); EP again with model.router_balance
                              global (its all-reduce on NCCL): the same first loss; SKIP below 2 GPUs
    packing_{sdpa,flash_attention_2}
                              scripts/gpu/packing_isolation.py says packed examples are isolated, and train.py's
                              eval loss of the initial weights is the same packed and unpacked (rel 1e-2 in
                              bf16), and so is ORPO's on preference pairs padded and padding-free (flash: one row,
                              its boundaries to the varlen kernel); flash_attention_2 SKIPs when flash_attn does
                              not import
    fsdp_sync_memory          FSDP2, grad_accum 4: peak GPU memory with distributed.fsdp_sync_each_micro_batch
                              true vs false (INFO: at world size 1 the shard is the whole model)
    fp8_vs_bf16               training.mixed_precision fp8 vs bf16, compiled, on the ~0.84B model of mfu (16
                              steps of 2048 tokens), fp8 also under FSDP2 (one-process mesh: torchao's float8
                              all-gather): the fp8 runs' layers on torch._scaled_mm, the mean loss of the last 8
                              steps within 3 % of bf16's, tokens/s of each (torchao via accelerate)
    mfu                       scripts/bench/gpu_figures.py --configs single,fsdp (0.84B model): its table copied
    offload_activations       training.offload_activations: the same losses as without (rel 1e-3), peak memory
                              and step time of both recorded
    loss_memory               disttrain.bench.memory (single, fsdp; vocab 152k, seq 4096): the loss's share of
                              peak memory and step time, full logits vs chunked vs TRL's fused head (its
                              Triton path); PASS when chunked cuts the share >= 8x

A failed item is recorded with the tail of its log and the others still run. When an item's time is up
(--timeout) its subprocess is SIGKILLed with every process under it. --jobs items run side by side (default
3 on a GPU: launches of the small model are mostly start-up); doctor_nccl, fsdp_sync_memory and mfu measure
the machine and always run alone. An item that would start with less of the --budget left than it needs is
SKIPped. acceptance.json / acceptance.md are rewritten after every item, so a run cut short still leaves
what finished. --out gets exactly three files (acceptance.json, acceptance.md, launches.log: every
subprocess's output); models, data and run dirs go to --work. Exit status: 0 when no item FAILed, 1
otherwise, 2 without a CUDA GPU (and no --dry-run).

--wheels DIR: `pip install --no-index --no-deps` of DIR's wheels before anything else, into site-packages
when it is writable, else (or with --site DIR) into a target dir put first on PYTHONPATH for every launch.
--no-deps skips version ranges, so every range of the carried packages' requirements and disttrain's own
(pyproject.toml) is then checked against what the machine has: each one not met is one line, printed and
recorded in the JSON (meta.wheels.pins), before the first item. A missing package fails only the items that
import it. `make gpu-kit` builds DIR (scripts/gpu/kit.py: pydantic and its core, datasets, DeepSpeed built
without ops, bitsandbytes slimmed to the machine's CUDA library); the GPU image has none of them.

Time on the H200 — an ESTIMATE, not a measurement (this script has never run on a GPU). One `accelerate
launch` of the small model (hidden 512, 4 layers, seq 512, 8 steps) is ~8-15 s there, almost all start-up
(imports, CUDA init, model load); DeepSpeed ~15-20 s. Per item (Item.estimate_s below):
    wheels ~30 s, model + corpus ~10 s, doctor_nccl ~15 s                                      ~55 s
    full_bf16_single 28, _fsdp 30, _zero2 38, _zero3 40, streaming_resume 28 (2 launches each); lora_ddp 15,
    lora_fsdp 18, qlora_ddp 18, qlora_fsdp 20, adamw_8bit 15, dpo 50, grpo 40, grpo_engines 120 (a 0.75B
    model, two launches, one compiling), reward_model 20, agent 45 (SFT then GRPO with a tool), distill 30,
    vlm_fsdp 25, vlm_zero3 35, moe_lora 25, packing_sdpa 35, packing_flash_attention_2 35 (a SKIP without
    flash-attn: ~2 s)                                                                                           680 s
    (moe_ep2 55, grpo_gather_fsdp2 / _zero3 and the other multi-GPU items SKIP on the one lent GPU: ~2 s each)
    in all; 3 side by side: ~225-250 s
    fsdp_sync_memory 30, mfu 90 (0.84B build ~20 s + 2 launches of 20 steps), loss_memory 80 (8 launches)  ~200 s
    fp8_vs_bf16 200 (the 0.84B build + 3 compiled launches of 16 steps; SKIPped when the budget is short)   ~200 s
    total ~10 min with --jobs 3; the default --budget 470 s keeps the whole run under 8 min, so the last items
    (mfu, fp8_vs_bf16, the long-context and loss-memory ones) may be SKIPped for the budget: name them with
    --items in a second run.
CPU dry run here (2 cores): the test's subset, measured below (tests/test_gpu_acceptance.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Only modules whose imports the bare GPU image has (stdlib, tqdm): disttrain.recipe.schema needs pydantic, which
# may arrive with --wheels. Everything else is imported inside the functions that use it.
from harness import FAIL, INFO, MAX_LOG_TAIL, PASS, REPO, SKIP, Ctx, Fail, Settings, Skip  # noqa: E402
from items.adapters import adapter  # noqa: E402
from items.dpo import dpo  # noqa: E402
from items.evaluation import eval_during_training  # noqa: E402
from items.long_context import long_context_single  # noqa: E402
from items.finetune import adamw_8bit, full_finetune  # noqa: E402
from items.measure import doctor_nccl, fp8_vs_bf16, fsdp_sync_memory, loss_memory, mfu, offload_activations  # noqa: E402
from items.moe import moe_expert_parallel, moe_lora  # noqa: E402
from items.packing import packing  # noqa: E402
from items.rl import agent, distill, grpo, grpo_engines, grpo_gather, reward_model  # noqa: E402
from items.vision import vision_language  # noqa: E402
from kit_install import install_wheels, wheels_line  # noqa: E402

GPU_FIGURES = REPO / "scripts/bench/gpu_figures.py"
# The acceptance model: Llama shape, random init, large enough that bf16 kernels are the real ones,
# small enough that a launch is start-up time (~13M parameters with the tiny tokenizer's vocabulary).
ACCEPT_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=2048)


@dataclass(frozen=True)
class Item:
    name: str
    run: Callable[[Ctx], tuple[str, str]]
    estimate_s: float  # on the H200: an ESTIMATE (never run there); not started with less budget left
    timeout_s: float  # killed after this (default; --timeout changes it)
    cpu: bool  # runs in --dry-run (tiny model; the timeouts fit it too)
    alone: bool = False  # measures the machine (bandwidth, memory, speed): never next to another item


ITEMS = [
    Item("doctor_nccl", doctor_nccl, 15, 90, True, alone=True),
    Item("full_bf16_single", partial(full_finetune, config="single_gpu"), 28, 120, True),
    Item("full_bf16_fsdp", partial(full_finetune, config="fsdp"), 30, 120, True),
    Item("full_bf16_zero2", partial(full_finetune, config="zero2"), 38, 150, True),
    Item("full_bf16_zero3", partial(full_finetune, config="zero3"), 40, 150, True),
    Item("streaming_resume", partial(full_finetune, config="single_gpu", streaming=True), 28, 120, True),
    Item("hsdp_2x2", partial(full_finetune, config="hsdp", nproc=4), 35, 150, False),  # SKIP below 4 GPUs
    Item("ulysses_sp2", partial(full_finetune, config="zero3_ulysses", nproc=2), 35, 150, False),  # SKIP below 2
    Item("context_parallel_cp2", partial(full_finetune, config="fsdp_cp", nproc=2), 35, 150, False),  # SKIP below 2
    Item("tensor_parallel_tp2", partial(full_finetune, config="tp", nproc=2), 35, 150, False),  # SKIP below 2
    Item("fsdp_tp_2x2", partial(full_finetune, config="fsdp_tp", nproc=4), 35, 150, False),  # SKIP below 4 GPUs
    Item("pipeline_pp2", partial(full_finetune, config="fsdp_pp", nproc=2), 35, 150, False),  # SKIP below 2 GPUs
    Item("lora_ddp", partial(adapter, config="ddp", quantized=False), 15, 60, True),
    Item("lora_fsdp", partial(adapter, config="fsdp", quantized=False), 18, 60, True),
    Item("lora_tp2", partial(adapter, config="tp", quantized=False, nproc=2), 18, 60, False),  # SKIP below 2
    Item("qlora_ddp", partial(adapter, config="ddp", quantized=True), 18, 60, False),
    Item("qlora_fsdp", partial(adapter, config="fsdp", quantized=True), 20, 60, False),
    Item("adamw_8bit", adamw_8bit, 15, 60, False),
    Item("dpo", dpo, 50, 150, True),
    Item("grpo", grpo, 40, 150, True),
    Item("grpo_engines", grpo_engines, 120, 400, True),
    Item("grpo_gather_fsdp2", partial(grpo_gather, config="fsdp"), 100, 300, False),  # SKIP below 2 GPUs
    Item("grpo_gather_zero3", partial(grpo_gather, config="zero3"), 120, 300, False),  # SKIP below 2 GPUs
    Item("reward_model", reward_model, 20, 90, True),
    Item("agent", agent, 45, 200, True),  # an SFT warm start, then GRPO calling a tool over several turns
    Item("distill", distill, 30, 150, True),  # two models on the GPU: the teacher frozen beside the student
    Item("vlm_fsdp", partial(vision_language, config="fsdp"), 25, 120, True),
    Item("vlm_zero3", partial(vision_language, config="zero3"), 35, 150, True),
    Item("eval_during_training", eval_during_training, 30, 120, True),
    Item("moe_lora", moe_lora, 25, 90, True),
    Item("moe_ep2", moe_expert_parallel, 55, 200, False),  # SKIP below 2 GPUs
    Item("packing_sdpa", partial(packing, attn="sdpa"), 35, 90, True),
    Item("packing_flash_attention_2", partial(packing, attn="flash_attention_2"), 35, 90, False),
    Item("fsdp_sync_memory", fsdp_sync_memory, 30, 90, False, alone=True),
    Item("offload_activations", offload_activations, 25, 90, True, alone=True),
    Item("fp8_vs_bf16", fp8_vs_bf16, 200, 360, True, alone=True),  # a 0.84B model built, three compiled launches
    Item("mfu", mfu, 90, 180, False, alone=True),
    # an 8B model built on the GPU, then 16k, 32k, 64k tokens: the longest that fits one GPU (LoRA, checkpointing,
    # activation offload); its own memory figures, so never beside another item
    Item("long_context_single", long_context_single, 240, 420, True, alone=True),
    Item("loss_memory", loss_memory, 80, 200, False, alone=True),
]


BY_NAME = {item.name: item for item in ITEMS}

# docs/gpu.md lists the items from here (`make docs`; tests/test_gpu_acceptance.py compares)
DOC_BEGIN = "<!-- BEGIN acceptance items: generated from scripts/gpu/acceptance.py by `make docs` -->"
DOC_END = "<!-- END acceptance items -->"


def items_markdown() -> str:
    """One row per item: what its function's docstring says it checks, its arguments, where it runs."""
    rows = [DOC_BEGIN, "", "| item | what it checks | CPU dry run | H200 estimate (s, never measured) |",
            "|---|---|---|---|"]
    for item in ITEMS:
        run = item.run.func if isinstance(item.run, partial) else item.run
        arguments = ", ".join(f"{k}={v}" for k, v in getattr(item.run, "keywords", {}).items())
        summary = re.split(r"(?<=\.) ", " ".join((run.__doc__ or "").split()))[0].replace("|", "\\|")
        rows.append(f"| `{item.name}` | {summary}{f' ({arguments})' if arguments else ''} | "
                    f"{'yes' if item.cpu else 'SKIP'} | {item.estimate_s:g} |")
    return "\n".join(rows + ["", DOC_END])


def write_docs(doc: Path) -> None:
    text = doc.read_text()
    start, stop = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
    doc.write_text(text[:start] + items_markdown() + text[stop:])



# ----------------------------------------------------------------------------- the run
def environment(dry_run: bool) -> dict:
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"device": gpu or f"CPU ({platform.machine()}, {os.cpu_count()} cores; dry run)", "dry_run": dry_run,
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "packages": {d: version(d) for d in ("accelerate", "transformers", "peft", "pydantic", "datasets",
                                                 "deepspeed", "bitsandbytes", "flash-attn", "wandb", "lm_eval")}}


def prepare(ctx: Ctx) -> None:
    """The model (random init, Llama shape) and a synthetic text corpus, made here like gpu_figures.py does."""
    sys.path.insert(0, str(GPU_FIGURES.parent))
    import gpu_figures

    gpu_figures.SHAPES.setdefault("accept", ACCEPT_SHAPE)
    rows = ctx.s.steps * ctx.s.micro_batch * 4  # grad_accum up to 4 (fsdp_sync_memory), + eval rows
    ctx.corpus = gpu_figures.write_corpus(ctx.work / "corpus.jsonl", 2 * rows * ctx.s.seq, ctx.s.seq)
    ctx.params = gpu_figures.build_model(ctx.s.shape, ctx.work / "model")
    ctx.model_dir = ctx.work / "model"  # set last: items FAIL at once when the model is missing


def run_item(ctx: Ctx, item: Item, timeout: float, dry_run: bool) -> dict:
    """One item: its status, detail, figures and (for a FAIL) the tail of the log that explains it."""
    ctx = ctx.for_item(item.name, timeout)
    started = time.monotonic()
    tail = None
    try:
        if dry_run and not item.cpu:
            raise Skip("needs a GPU (dry run on CPU)")
        if ctx.model_dir is None:
            raise Fail("the model and corpus could not be built (meta.prepare_error says why)")
        status, detail = item.run(ctx)
    except Skip as exc:
        status, detail = SKIP, str(exc)
    except Fail as exc:
        status, detail = FAIL, exc.detail
        if exc.log is not None and exc.log.is_file():
            tail = exc.log.read_text()[-MAX_LOG_TAIL:]
    except Exception as exc:  # a bug or a surprise in one item must not cost the others their minutes
        status, detail = FAIL, f"{type(exc).__name__}: {exc}"
        tail = traceback.format_exc()[-MAX_LOG_TAIL:]
    row = {"item": item.name, "status": status, "detail": detail, "seconds": round(time.monotonic() - started, 1),
           "timeout_s": timeout, "figures": ctx.figures}
    if tail:
        row["log_tail"] = tail
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    env = meta["environment"]
    lines = [f"# GPU acceptance: {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}, NCCL {env['nccl']}), python {env['python']}; "
             + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
             + "; not installed: " + (", ".join(k for k, v in env["packages"].items() if not v) or "-"), ""]
    if meta.get("wheels"):
        lines += [f"wheels from {meta['wheels']['dir']}: {wheels_line(meta['wheels'])}", ""]
    counts = {s: sum(r["status"] == s for r in rows) for s in (PASS, FAIL, SKIP, INFO)}
    lines += [f"{counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP, {counts[INFO]} INFO "
              f"in {meta['seconds']:.0f} s{' (dry run)' if env['dry_run'] else ''}", "",
              "| item | status | seconds | detail |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['item']} | {r['status']} | {r['seconds']:g} | {r['detail'].replace('|', '/')} |")
    for r in rows:
        if r["figures"].get("table"):
            lines += ["", f"## {r['item']}", "", r["figures"]["table"].strip()]
    for r in rows:
        if r.get("log_tail"):
            lines += ["", f"## {r['item']}: {r['status']}", "", "```", r["log_tail"].strip()[-2500:], "```"]
    return "\n".join(lines) + "\n"


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    (out / "acceptance.json").write_text(json.dumps({"meta": meta, "items": rows}, indent=1))
    (out / "acceptance.md").write_text(markdown(meta, rows))


def parse_timeouts(values: list[str], names: list[str]) -> dict[str, float]:
    """`--timeout 120` (every item) and/or `--timeout lora_ddp=5,mfu=200` (named items)."""
    timeouts = {name: BY_NAME[name].timeout_s for name in names}
    for value in values:
        for part in value.split(","):
            name, sep, seconds = part.rpartition("=")
            if not sep:
                timeouts = dict.fromkeys(timeouts, float(seconds))
            elif name not in BY_NAME:
                raise SystemExit(f"error: --timeout {part}: unknown item {name!r}")
            else:
                timeouts[name] = float(seconds)
    return timeouts


class Runner:
    """Runs the items in the order asked: `jobs` at a time, except that an `alone` item waits for the
    running ones and runs by itself. Each row is printed and the results are rewritten as soon as it ends."""

    def __init__(self, ctx: Ctx, out: Path, meta: dict, names: list[str], timeouts: dict[str, float],
                 budget: float, dry_run: bool, started: float):
        self.ctx, self.out, self.meta, self.names = ctx, out, meta, names
        self.timeouts, self.budget, self.dry_run, self.started = timeouts, budget, dry_run, started
        self.rows: dict[str, dict] = {}

    def one(self, name: str) -> None:
        item = BY_NAME[name]
        left = self.budget - (time.monotonic() - self.started)
        need = max(20, item.estimate_s)
        if left < need and (item.cpu or not self.dry_run):
            row = {"item": name, "status": SKIP, "seconds": 0, "timeout_s": 0, "figures": {},
                   "detail": f"not started: {max(left, 0):.0f} s of the --budget of {self.budget:g} s left, "
                             f"it needs ~{need:g} s"}
        else:
            row = run_item(self.ctx, item, min(self.timeouts[name], left), self.dry_run)
        with self.ctx.lock:
            self.rows[name] = row
            print(f"{row['status']:<4}  {name:<26} {row['seconds']:>6.1f}s  {row['detail']}", flush=True)
            self.write()

    def write(self) -> None:
        self.meta["seconds"] = round(time.monotonic() - self.started, 1)
        write_results(self.out, self.meta, [self.rows[n] for n in self.names if n in self.rows])

    def run(self, jobs: int) -> list[dict]:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = []
            for name in self.names:
                if jobs > 1 and BY_NAME[name].alone:
                    for future in running:
                        future.result()
                    running = []
                    self.one(name)
                else:
                    running.append(pool.submit(self.one, name))
            for future in running:
                future.result()
        self.write()
        return [self.rows[n] for n in self.names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="acceptance.json/.md and launches.log go here (required)")
    parser.add_argument("--work", type=Path, default=None,
                        help="model, corpus and run dirs (default: a fresh temporary dir; kept out of --out)")
    parser.add_argument("--items", default=",".join(BY_NAME), help=f"comma-separated, of {', '.join(BY_NAME)}")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="pip install the .whl files of this dir first (the folder `make gpu-kit` builds)")
    parser.add_argument("--site", type=Path, default=None,
                        help="install the wheels into this dir (put first on PYTHONPATH) instead of site-packages; "
                             "default: site-packages when writable, else a temp dir")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: tiny model, 4 steps, fp32; GPU-only items SKIP")
    parser.add_argument("--timeout", action="append", default=[], metavar="S|ITEM=S[,ITEM=S]",
                        help="seconds per item (all items, or the named ones); default: each item's own")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run: items that would start later are SKIPped "
                             "(default 470 on a GPU, none in a dry run)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="items run side by side (default 3 on a GPU, 1 in a dry run); doctor_nccl, "
                             "fsdp_sync_memory and mfu always run alone")
    parser.add_argument("--write-docs", type=Path, default=None, metavar="MD",
                        help="write the items table into this file (docs/gpu.md) and exit")
    args = parser.parse_args(argv)
    if args.write_docs:
        write_docs(args.write_docs)
        return 0
    if args.out is None:
        parser.error("the following arguments are required: --out")
    names = [n for n in args.items.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown --items {unknown}; known: {', '.join(BY_NAME)}")
    timeouts = parse_timeouts(args.timeout, names)
    budget = args.budget if args.budget is not None else (math.inf if args.dry_run else 470)
    jobs = args.jobs or (1 if args.dry_run else 3)
    started = time.monotonic()  # the budget counts the wheels and the model build too

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU visible (torch.cuda.is_available() is False); on CPU use --dry-run", file=sys.stderr)
        return 2
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("WANDB_MODE", "offline")):
        os.environ.setdefault(key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("acceptance.json", "acceptance.md", "launches.log"):
        (args.out / name).unlink(missing_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="disttrain_acceptance_"))
    marker = work / ".disttrain_acceptance"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        parser.error(f"--work {work} holds other files; give an empty or new directory (it is wiped)")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.touch()
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "work": str(work), "budget_s": None if math.isinf(budget) else budget, "jobs": jobs, "seconds": 0}
    if args.wheels:
        meta["wheels"] = install_wheels(args.wheels, args.site)
        print(f"wheels: {wheels_line(meta['wheels'])}", flush=True)
        for line in meta["wheels"].get("pins", []):
            print(f"pin not met: {line}", flush=True)
    meta["environment"] = environment(args.dry_run)
    ctx = Ctx(s=Settings.for_run(args.dry_run), work=work, launches_log=args.out / "launches.log")
    ctx.launches_log.touch()
    try:
        prepare(ctx)
        meta["model"] = {"shape": ctx.s.shape, "params": ctx.params, "seq": ctx.s.seq, "steps": ctx.s.steps,
                         "precision": ctx.s.precision}
    except Exception as exc:  # every item then FAILs with this line instead of the run dying silently
        meta["prepare_error"] = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    rows = Runner(ctx, args.out, meta, names, timeouts, budget, args.dry_run, started).run(jobs)
    print(f"wrote {args.out / 'acceptance.json'}, {args.out / 'acceptance.md'}, {args.out / 'launches.log'}")
    return 1 if any(r["status"] == FAIL for r in rows) else 0



if __name__ == "__main__":
    sys.exit(main())

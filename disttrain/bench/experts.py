"""`make bench-experts`: expert parallelism against FSDP2 alone on a mixture of experts, measured on this machine.

    python -m disttrain.bench.experts                       # 2 CPU processes, EP 2
    python -m disttrain.bench.experts --nproc 4 --ep 2      # two copies of each expert, FSDP2-sharded

A Qwen3-MoE-shaped model whose experts hold most of its weights (8 per block, 2 per token: `moe_config`) is made
locally; then, each on the same rows:
- states: one optimizer step in a launch under fsdp_ep.yaml, every process summing what it holds of the weights,
  gradients and AdamW's states (its local shards); set beside `make cost`'s figure for the same model and mesh
  (disttrain/tools/cost.py), which tests/test_expert_parallel.py holds within 15 %;
- step time and peak memory per process: train.py under fsdp.yaml and under fsdp_ep.yaml (median step after
  warm-up; peak RSS on CPUs, which holds the allocator's cache: compare the two, not the absolute values), and
  the planner's experts' traffic per micro-batch for both.
Writes <out>/results.json and results.md (default bench/experts). CPU figures say nothing about NVLink or
InfiniBand; the GPU acceptance item `moe_ep2` (scripts/gpu/items/moe.py) measures throughput on GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disttrain.errors import exit_on_user_error

REPO = Path(__file__).resolve().parents[2]


def moe_config(vocab_size: int, eos: int, pad: int, **overrides):
    """Qwen3-MoE with 8 experts per block, 2 per token: the experts hold most of the weights, as in the real ones."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                                    moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=512, mlp_only_layers=[], decoder_sparse_step=1,
                                    tie_word_embeddings=False, eos_token_id=eos, pad_token_id=pad), **overrides})


def build_moe(out: Path) -> Path:
    import torch
    from transformers import Qwen3MoeForCausalLM

    from disttrain.tools.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(moe_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def held_states(model, optimizer) -> int:
    """Bytes of the weights, gradients and optimizer states this process holds (its shards)."""
    import torch

    params = [p for p in model.parameters()]
    total = sum(_local_bytes(p) for p in params) + sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def states_worker(model_dir: str, out: str) -> None:
    """Run under `accelerate launch --config_file accelerate_configs/fsdp_ep.yaml`: the model loaded as train.py
    loads it for this launch's plan, one AdamW step, each process's held bytes written to `out` (rank 0)."""
    import torch
    import torch.distributed as dist

    from disttrain.model.loading import load_model
    from disttrain.parallel.plan import ParallelPlan
    from disttrain.recipe.schema import ModelSection

    dist.init_process_group("gloo")
    plan = ParallelPlan.from_launch()
    torch.manual_seed(0)
    model = load_model(ModelSection(name_or_path=model_dir, dtype="float32"), None, **plan.load_kwargs())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, model.config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    held = torch.tensor([held_states(model, optimizer)], dtype=torch.float64)
    every = [torch.zeros_like(held) for _ in range(dist.get_world_size())]
    dist.all_gather(every, held)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"mesh": plan.mesh, "bytes": [int(t.item()) for t in every]}))
    dist.barrier()
    dist.destroy_process_group()


def measured_states(model_dir: Path, nproc: int, ep: int, out: Path) -> dict:
    """{"mesh", "bytes": per process} from a launch of states_worker under fsdp_ep.yaml."""
    import os
    import subprocess

    from disttrain.runtime.launcher import launch_command

    cmd = launch_command("fsdp_ep", nproc, "disttrain/bench/experts.py", "--worker", str(model_dir), str(out),
                         launcher_args=("--parallelism_config_dp_shard_size", str(nproc)))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PARALLELISM_CONFIG_EP_SIZE": str(ep), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"states launch failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def planned_states_gb(model_dir: Path, nproc: int, ep: int) -> float:
    """`make cost`'s states per GPU for this model in fp32 with AdamW (16 bytes a parameter), under fsdp_ep."""
    from transformers import AutoConfig

    from disttrain.metrics.flops import shape_from_config
    from disttrain.model.family import Family
    from disttrain.tools.cost import Workload, model_states_gb

    config = AutoConfig.from_pretrained(model_dir)
    shape = shape_from_config(config)
    w = Workload(shape.params, shape, 0.0, 64, 2, False, routing=Family.of(config).routing)
    from disttrain.tools.cost import MESHES

    return model_states_gb(w, MESHES["fsdp_ep"], nproc)[0]


def timed(model_dir: Path, strategy: str, nproc: int, ep: int, steps: int, run_dir: Path) -> dict:
    from disttrain.bench.strategies import run_strategy, summarize

    recipe = run_dir.parent / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {model_dir}, dtype: float32}}\n"
                      f"data: {{path: {REPO / 'data/tiny_alpaca.jsonl'}, format: alpaca, max_seq_len: 128}}\n"
                      "training: {micro_batch_size: 4, grad_accum: 1, lr: 1.0e-4, mixed_precision: 'no'}\n"
                      f"output: {{dir: {run_dir}}}\n")
    args = ("--parallelism_config_dp_shard_size", str(nproc)) if strategy == "fsdp_ep" else ()
    env = {"PARALLELISM_CONFIG_EP_SIZE": str(ep)} if strategy == "fsdp_ep" else None
    records = run_strategy(str(recipe), strategy, nproc, steps, run_dir, [], launcher_args=args, env=env)
    summary = summarize(strategy, records, warmup=2)
    return {"strategy": strategy, "step_time_p50_s": summary["step_time_p50_s"],
            "peak_mem_gb": summary["peak_mem_gb"], "final_loss": summary["final_loss"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="bench/experts")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_moe(out / "model")
    states = measured_states(model_dir, args.nproc, args.ep, out / "states.json")
    planned = planned_states_gb(model_dir, args.nproc, args.ep)
    measured = max(states["bytes"]) / 1e9
    runs = [timed(model_dir, s, args.nproc, args.ep, args.steps, out / s) for s in ("fsdp", "fsdp_ep")]
    result = {"nproc": args.nproc, "ep": args.ep, "mesh": states["mesh"],
              "states_gb_measured_max": measured, "states_gb_planned": planned,
              "states_planned_over_measured": planned / measured, "runs": runs,
              "step_time_ep_over_fsdp": runs[1]["step_time_p50_s"] / runs[0]["step_time_p50_s"]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Expert parallelism vs FSDP2 alone ({args.nproc} CPU processes, ep {args.ep}: {states['mesh']})", "",
             f"- model states per process: measured {measured * 1e3:.2f} MB (max over processes; "
             f"{', '.join(f'{b / 1e6:.2f}' for b in states['bytes'])} MB), `make cost` plans {planned * 1e3:.2f} MB "
             f"(ratio {planned / measured:.3f})", "",
             "| strategy | step time p50 (s) | peak RSS per process (GB) | loss at the end |", "|---|---|---|---|",
             *[f"| {r['strategy']} | {r['step_time_p50_s']:.4f} | {r['peak_mem_gb']:.2f} | {r['final_loss']:.4f} |"
               for r in runs], "",
             f"EP / FSDP2 step time: {result['step_time_ep_over_fsdp']:.2f} (one invocation, this machine: CPU "
             "processes over gloo, where the all-to-all is a memory copy; GPUs: the acceptance item moe_ep2)."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        states_worker(*sys.argv[2:4])
    else:
        with exit_on_user_error():
            main(sys.argv[1:])

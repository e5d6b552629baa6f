"""The mixture-of-experts item: a small Qwen3-MoE (8 experts, 2 per token) built here, LoRA on attention and on
the experts' fused weights with the router's load-balancing loss, in bf16 under FSDP2 -- on the GPU transformers
runs the experts with its grouped_mm kernels (on CPU an eager loop), which is what this checks; MFU logged."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, check_adapter_export, read_metrics, recipe, require_finite_losses, train

MOE_SHAPE = {"cuda": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64),
             "cpu": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)}
LORA_EXPERTS = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def build_moe(ctx: Ctx):
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = ctx.item_dir / "model"
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), num_experts=8, num_experts_per_tok=2, mlp_only_layers=[],
                            decoder_sparse_step=1, max_position_embeddings=2048, tie_word_embeddings=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **MOE_SHAPE[ctx.s.device])
    torch.manual_seed(0)
    with ctx.lock:  # from_pretrained/save_pretrained patch torch's init functions: one at a time
        Qwen3MoeForCausalLM(config).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return out


def moe_lora(ctx: Ctx) -> tuple[str, str]:
    """A Qwen3-MoE-shaped model under FSDP2, LoRA on attention and the fused experts, the router loss on: finite
    losses, expert adapters exported, an MFU within (0, 1] (active parameters counted)."""
    model = build_moe(ctx)
    run = ctx.item_dir / "run"
    tree = recipe(ctx, run, model={"name_or_path": str(model), "router_aux_loss_coef": 0.01}, lora=LORA_EXPERTS,
                  training={"lr": 1e-3})
    _, log = train(ctx, "run", "fsdp", tree)
    found = require_finite_losses(run, ctx.s.steps, log)
    names = check_adapter_export(run / "final", log)
    if not any("experts" in name for name in names):
        raise Fail("the exported adapter holds no expert weights (lora.target_parameters did not apply)", log)
    mfu = [r["mfu"] for r in read_metrics(run) if "mfu" in r]
    if not mfu or not all(0 < m <= 1 for m in mfu):
        raise Fail(f"MFU outside (0, 1]: {mfu[:5]} (the active-parameter FLOP count?)", log)
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps], adapter_tensors=len(names), mfu=mfu[-1])
    return PASS, (f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); expert adapters "
                  f"exported; MFU {mfu[-1]:.1%}")

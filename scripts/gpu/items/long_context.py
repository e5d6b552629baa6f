"""The single-GPU long-context item: the longest sequence an 8B-class LoRA trains on one GPU with the chunked
loss, gradient checkpointing and activation offload, and its tokens/s (issue 25's single-GPU figure)."""

from __future__ import annotations

from harness import LORA, PASS, Ctx, Fail, read_metrics, recipe, train

# Llama-3.1-8B's body and vocabulary (8.03B parameters), random init: the activations and the loss are what
# decide the fit, and both depend on the shape only
BODY_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, vocab_size=128256)
LENGTHS = (16384, 32768, 65536)  # doubled until one does not fit; 3 steps each
DRY_LENGTHS = (256, 512)  # the CPU dry run: the items' tiny model, the same code path


def _build_8b(out) -> int:
    """Tokenizer (the tiny one: its ids are valid in any larger vocabulary) + the 8B-shaped model in bf16, built
    on the GPU (initialising 8B parameters on the host takes minutes) and saved once."""
    import torch
    from transformers import AutoModelForCausalLM

    from disttrain.tools.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    config = tiny_llama_config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=None, **BODY_8B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return params


def long_context_single(ctx: Ctx) -> tuple[str, str]:
    """LoRA (r 8 on every linear layer) on the 8B shape, bf16 weights, gradient checkpointing, activation offload to
    pinned host memory, the chunked loss; one packed row of L tokens per step, L doubled from 16k: the longest L that
    trains 3 finite steps, its tokens/s and peak memory; the first L that does not fit (CUDA out of memory) ends
    the search. The dry run takes the same path on the items' tiny model at 256 and 512 tokens."""
    import gpu_figures  # on sys.path since acceptance.prepare

    dry = ctx.s.device == "cpu"
    lengths = DRY_LENGTHS if dry else LENGTHS
    model_dir, params = ctx.model_dir, ctx.params
    if not dry:
        model_dir = ctx.item_dir / "model_8b"
        params = _build_8b(model_dir)
    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    fitted, summary = {}, []
    for length in lengths:
        label = f"seq_{length}"
        corpus = gpu_figures.write_corpus(ctx.item_dir / f"{label}.jsonl", 4 * length, length)
        run = ctx.item_dir / label
        tree = recipe(ctx, run, model={"name_or_path": str(model_dir), "dtype": "float32" if dry else "bfloat16",
                                       "gradient_checkpointing": True},
                      data={"path": str(corpus), "max_seq_len": length, "packing": True},
                      training={"max_steps": 3, "micro_batch_size": 1, "grad_accum": 1, "offload_activations": True,
                                "loss_impl": "chunked", "warmup_steps": 0},
                      lora=dict(LORA), output={"save_final_model": False, "checkpoint_at_end": False})
        try:
            _, log = train(ctx, label, "single_gpu", tree)
        except Fail as exc:
            text = exc.log.read_text() if exc.log is not None and exc.log.is_file() else ""
            if "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text:
                summary.append(f"{length}: out of memory")
                break
            raise
        records = [r for r in read_metrics(run) if "loss" in r]
        if len(records) != 3 or not all(r["loss"] == r["loss"] for r in records):
            raise Fail(f"{label}: expected 3 finite loss lines, got {[r.get('loss') for r in records]}", log)
        last = records[-1]  # after the first step's warm-up
        fitted[length] = {"tokens_per_s": last["tokens_per_s_per_device"], "peak_mem_gb": last["peak_mem_gb"]}
        summary.append(f"{length}: {last['tokens_per_s_per_device']:,.0f} tok/s, peak {last['peak_mem_gb']:.1f} GB")
    if not fitted:
        raise Fail(f"not even {lengths[0]} tokens fit: " + "; ".join(summary))
    longest = max(fitted)
    ctx.figures.update(params=params, lengths=fitted, longest=longest)
    return PASS, f"longest {longest} tokens ({params / 1e9:.2f}B LoRA); " + "; ".join(summary)

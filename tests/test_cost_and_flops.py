"""FLOPs formula and the cost / memory planner against hand-computed cases."""

import json

import pytest
import torch

from conftest import REPO
from disttrain.errors import DisttrainError
from disttrain.tools.cost import ASSUMED_MFU, Workload, main, model_states_gb
from disttrain.metrics.flops import shape_from_config, training_flops_per_token
from disttrain.metrics.hardware import ACCELERATORS, lookup
from disttrain.tools.preflight import find_config_dir


def config(name):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(find_config_dir(name))


def test_parameter_counts_of_real_configs():
    qwen = shape_from_config(config("Qwen/Qwen2.5-7B-Instruct"))
    assert qwen.params == 7_615_616_512  # the published count
    # matmuls = everything but the embedding table, 2 x 28 + 1 norms and q/k/v biases
    biases = 28 * (3584 + 2 * 512)
    norms = 3584 * (2 * 28 + 1)
    assert qwen.matmul_params == qwen.params - 152064 * 3584 - norms - biases
    llama = shape_from_config(config("meta-llama/Llama-3.1-8B-Instruct"))
    assert llama.params == 8_030_261_248
    assert llama.matmul_params == 8_030_261_248 - 128256 * 4096 - 4096 * 65
    tied = shape_from_config(config("Qwen/Qwen2.5-0.5B-Instruct"))
    assert tied.params == 494_032_768
    # tied: the output projection is still a matmul (its weight is the embedding)
    assert tied.matmul_params == tied.params - 896 * (2 * 24 + 1) - 24 * (896 + 2 * 128) + 0


def test_moe_counts_all_experts_for_memory_and_the_routed_ones_for_compute():
    """The published totals (30.5B, 46.7B); per token only top-k of the experts' weights multiply (8 of 128,
    2 of 8), plus attention, the router and the output projection."""
    qwen = shape_from_config(config("Qwen/Qwen3-30B-A3B"))
    assert qwen.params == 30_532_122_624
    experts = 48 * 128 * 3 * 768 * 2048  # gate, up and down of every expert, fused as [E, out, in]
    assert qwen.expert_params == experts
    embedding, norms = 151936 * 2048, 48 * (2 * 2048 + 2 * 128) + 2048
    assert qwen.matmul_params == qwen.params - embedding - norms - experts + experts * 8 // 128  # ~3.0B active
    mixtral = shape_from_config(config("mistralai/Mixtral-8x7B-Instruct-v0.1"))
    assert mixtral.params == 46_702_792_704
    experts = 32 * 8 * 3 * 14336 * 4096
    assert mixtral.matmul_params == mixtral.params - 32000 * 4096 - 4096 * 65 - experts + experts * 2 // 8


def test_flops_per_token_by_hand():
    llama = shape_from_config(config("meta-llama/Llama-3.1-8B-Instruct"))
    expected = 6 * 7_504_658_432 + 12 * 32 * 32 * 128 * 4096
    assert training_flops_per_token(llama, 4096) == expected
    lora = training_flops_per_token(llama, 4096, trainable_params=20_000_000)
    assert lora == 4 * 7_504_658_432 + 6 * 20_000_000 + 12 * 32 * 32 * 128 * 4096


MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, mlp_only_layers=[]),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("make_config", ["llama", "qwen2", "qwen3_moe", "mixtral"])
def test_formula_matches_torch_flop_counter(make_config):
    """Within a few % of FlopCounterMode on real tiny models of four architectures (forward + backward); the
    MoE ones route each token to 2 experts, which the active-parameter count must reproduce."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig,
           "mixtral": MixtralConfig}[make_config]
    cfg = cls(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, **MOE.get(make_config, {}))
    cfg._attn_implementation = "eager"  # CPU SDPA kernels are invisible to FlopCounterMode; eager is plain matmuls
    cfg._experts_implementation = "eager"  # so are grouped_mm's: eager experts are one matmul per expert
    model = AutoModelForCausalLM.from_config(cfg)
    seq = 256
    ids = torch.randint(0, 1000, (2, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    measured = counter.get_total_flops() / ids.numel()
    formula = training_flops_per_token(shape_from_config(cfg), seq)
    assert formula == pytest.approx(measured, rel=0.03)


def test_peaks_are_dense():
    assert lookup("H100").peak_tflops == 989 and lookup("h200").peak_tflops == 989
    assert lookup("rtx4090").memory_gb == 24
    assert all(a.peak_tflops < 2500 for a in ACCELERATORS.values())  # no "with sparsity" figures


def test_memory_model_by_hand():
    w = Workload(params=7e9, shape=None, tokens=1e9, seq_len=2048, micro_batch=1, gradient_checkpointing=False)
    assert model_states_gb(w, "ddp", 8)[0] == pytest.approx(112.0)
    assert model_states_gb(w, "zero1", 8)[0] == pytest.approx(28 + 10.5)
    assert model_states_gb(w, "zero2", 8)[0] == pytest.approx(14 + 12.25)
    assert model_states_gb(w, "zero3", 8)[0] == pytest.approx(14.0)
    assert model_states_gb(w, "zero3_offload", 8)[1] == pytest.approx(112.0)
    lora = Workload(7e9, None, 1e9, 2048, 1, False, lora_params=40e6)
    assert model_states_gb(lora, "ddp", 8)[0] == pytest.approx(14 + 0.64)
    assert model_states_gb(lora, "fsdp", 8)[0] == pytest.approx((14 + 0.64) / 8)


def test_fsdp_no_sync_micro_batches_add_unsharded_gradients_per_gpu(tmp_path):
    """distributed.fsdp_sync_each_micro_batch=false with accumulation: the planner adds the unsharded fp32
    gradients (not divided by the GPU count), as tests/test_fsdp_gradients.py measures them held."""
    import yaml

    from disttrain.tools.cost import workload_from_recipe

    w = Workload(8e9, None, 1e9, 2048, 1, False, fsdp_unsharded_grad_bytes=4.0)
    assert model_states_gb(w, "fsdp", 8)[0] == pytest.approx(16.0 + 32.0)
    assert model_states_gb(w, "zero3", 8)[0] == pytest.approx(16.0)
    recipe = yaml.safe_load((REPO / "recipes/llama-3.1-8b/full_sft_fsdp.yaml").read_text())
    recipe["training"]["grad_accum"] = 4
    recipe.setdefault("distributed", {})["fsdp_sync_each_micro_batch"] = False
    path = tmp_path / "no_sync.yaml"
    path.write_text(yaml.safe_dump(recipe))
    no_sync, _ = workload_from_recipe(str(path))
    default, _ = workload_from_recipe(str(REPO / "recipes/llama-3.1-8b/full_sft_fsdp.yaml"))
    extra = model_states_gb(no_sync, "fsdp", 8)[0] - model_states_gb(default, "fsdp", 8)[0]
    assert extra == pytest.approx(4 * default.params / 1e9)


def test_seed_example_7b_100b_tokens_on_4_rtx4090_fsdp(capsys):
    """The seed chapter printed 22.8 hours and $72 for this; the real figure is ~200x that."""
    main(["--params", "7e9", "--tokens", "100e9", "--gpu", "RTX 4090", "--gpus", "4", "--strategy", "fsdp", "--json"])
    result = json.loads(capsys.readouterr().out)
    fsdp = next(r for r in result["rows"] if r["strategy"] == "fsdp")
    assert result["total_flops"] == pytest.approx(6 * 7e9 * 100e9)
    seconds = 6 * 7e9 * 100e9 / (4 * 165e12 * ASSUMED_MFU["fsdp"])
    assert fsdp["hours"] == pytest.approx(seconds / 3600)          # ~5,050 h = 210 days
    assert fsdp["cost"] == pytest.approx(seconds / 3600 * 4 * 0.8)  # ~$16,000
    assert fsdp["states_gb"] == pytest.approx(28.0) and not fsdp["fits"]  # 16 B/param / 4 GPUs > 24 GB
    assert result["recommended"] in ("fsdp_offload", "zero3_offload")
    main(["--params", "7e9", "--tokens", "100e9", "--gpu", "RTX 4090", "--gpus", "4", "--strategy", "fsdp"])
    text = capsys.readouterr().out
    assert "fsdp: DOES NOT FIT (30.0 GB needed of 24 GB per GPU), 210.4 days, $16,162" in text


def test_recipe_plan_and_measured_mfu(tmp_path, capsys):
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"results": [{"strategy": "ddp", "mfu": 0.5}]}))
    main(["--recipe", "recipes/qwen2.5-7b/lora_sft.yaml", "--tokens", "1e9", "--gpu", "H100", "--gpus", "8",
          "--bench", str(bench), "--json"])
    result = json.loads(capsys.readouterr().out)
    ddp = next(r for r in result["rows"] if r["strategy"] == "ddp")
    assert ddp["mfu"] == 0.5 and ddp["mfu_source"].startswith("measured")
    assert ddp["fits"] and result["recommended"] == "ddp"  # LoRA on 7B: replicas fit an 80 GB card
    assert "LoRA r=16" in result["model"]


def test_chunked_loss_keeps_one_chunk_of_logits_whatever_the_sequence():
    """training.loss_impl=plain holds 10 bytes x tokens x vocab of logits; chunked one fp32 chunk and its gradient
    (disttrain/objectives/token_loss.py CHUNK_LOGITS), as tests/test_loss_impl.py shows it computing the same loss."""
    from disttrain.tools.cost import activations_gb
    from disttrain.metrics.flops import ModelShape
    from disttrain.objectives.token_loss import CHUNK_LOGITS

    shape = ModelShape(params=7e9, matmul_params=7e9, layers=28, heads=28, head_dim=128, hidden=3584, vocab=152064)
    plain = Workload(7e9, shape, 1e9, 4096, 4, True, loss_impl="plain")
    chunked = Workload(7e9, shape, 1e9, 4096, 4, True, loss_impl="chunked")
    logits_plain = 10 * 4 * 4096 * 152064 / 1e9  # ~24.9 GB
    assert activations_gb(plain) - activations_gb(chunked) == pytest.approx(logits_plain - 8 * CHUNK_LOGITS / 1e9)


def test_meshes_hsdp_shards_states_within_a_replica_and_ulysses_divides_activations(capsys):
    """--hsdp-replicas R: the hsdp row holds FSDP2's states over GPUS / R GPUs; --sp S: the zero3_ulysses row
    holds ZeRO-3's states over all GPUs and 1/S of every activation term (layers and logits); the shipped
    mesh recipes fit where their comments say."""
    from disttrain.metrics.flops import ModelShape
    from disttrain.tools.cost import activations_gb

    shape = ModelShape(params=7e9, matmul_params=7e9, layers=28, heads=28, head_dim=128, hidden=3584, vocab=152064)
    for loss_impl in ("plain", "chunked"):
        w = Workload(7e9, shape, 1e9, 32768, 1, False, loss_impl=loss_impl)
        assert activations_gb(w, 4) == pytest.approx(activations_gb(Workload(7e9, shape, 1e9, 8192, 1, False,
                                                                              loss_impl=loss_impl)))
    main(["--recipe", str(REPO / "recipes/qwen2.5-7b/long_sft_32k.yaml"), "--tokens", "1e9", "--gpus", "8",
          "--sp", "4", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    ulysses, zero3 = rows["zero3_ulysses"], rows["zero3"]
    assert ulysses["states_gb"] == zero3["states_gb"] and ulysses["activations_gb"] < zero3["activations_gb"] / 3.9
    assert ulysses["fits"] and not zero3["fits"] and "hsdp" not in rows
    main(["--recipe", str(REPO / "recipes/qwen2.5-32b/full_sft_hsdp.yaml"), "--tokens", "1e9", "--gpus", "16",
          "--hsdp-replicas", "2", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["hsdp"]["states_gb"] == pytest.approx(2 * rows["fsdp"]["states_gb"]) and rows["hsdp"]["fits"]
    assert "zero3_ulysses" not in rows
    with pytest.raises(DisttrainError, match="--sp 3 must divide --gpus 8"):
        main(["--params", "7e9", "--tokens", "1e9", "--gpus", "8", "--sp", "3"])
    # --cp C: the fsdp_cp row holds FSDP2's states over all GPUs and 1/C of the activations; the 64k recipe fits
    # with CP=8 and without recomputation, where FSDP2 alone does not (and CP=4 does not either)
    main(["--recipe", str(REPO / "recipes/llama-3.1-8b/long_sft_64k.yaml"), "--tokens", "1e9", "--gpus", "8",
          "--cp", "8", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    ring, fsdp = rows["fsdp_cp"], rows["fsdp"]
    assert ring["states_gb"] == fsdp["states_gb"] and ring["activations_gb"] < fsdp["activations_gb"] / 7.9
    assert ring["fits"] and not fsdp["fits"] and "zero3_ulysses" not in rows
    main(["--recipe", str(REPO / "recipes/llama-3.1-8b/long_sft_64k.yaml"), "--tokens", "1e9", "--gpus", "8",
          "--cp", "4", "--json"])
    assert not {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}["fsdp_cp"]["fits"]
    with pytest.raises(DisttrainError, match="--cp 3 must divide --gpus 8"):
        main(["--params", "7e9", "--tokens", "1e9", "--gpus", "8", "--cp", "3"])


def test_preference_reference_memory_and_flops(tmp_path):
    """DPO: `reference: model` adds a frozen copy of the weights sharded like the policy (whole under DDP and
    ZeRO-1/2, divided under FSDP2/ZeRO-3, host RAM when offloading); every reference adds a forward pass of
    FLOPs per token (live each step; precomputed once over the data); LoRA's disabled adapters hold nothing."""
    import yaml

    from disttrain.tools.cost import flops_per_token, reference_flops_per_token, workload_from_recipe

    plain = Workload(7e9, None, 1e9, 2048, 1, False)
    live = Workload(7e9, None, 1e9, 2048, 1, False, reference="model")
    for strategy, (gpu, host) in {"ddp": (14.0, 0), "zero2": (14.0, 0), "fsdp": (14.0 / 8, 0),
                                  "zero3": (14.0 / 8, 0), "zero3_offload": (0, 14.0)}.items():
        extra = [a - b for a, b in zip(model_states_gb(live, strategy, 8), model_states_gb(plain, strategy, 8))]
        assert extra == pytest.approx([gpu, host]), strategy
    assert flops_per_token(live) == pytest.approx(8 * 7e9)
    assert flops_per_token(Workload(7e9, None, 1e9, 2048, 1, False, reference="precomputed")) == pytest.approx(8 * 7e9)
    assert flops_per_token(plain) == pytest.approx(6 * 7e9)

    lora, title = workload_from_recipe(str(REPO / "recipes/qwen2.5-7b/dpo_lora.yaml"))
    assert lora.reference == "adapters" and "DPO reference: adapters" in title
    assert lora.micro_batch == 4  # 2 pairs = 4 sequences
    sft, _ = workload_from_recipe(str(REPO / "recipes/qwen2.5-7b/lora_sft.yaml"))
    assert model_states_gb(lora, "ddp", 8) == model_states_gb(sft, "ddp", 8)  # no second copy
    forward = 2 * lora.shape.matmul_params + 4 * lora.shape.layers * lora.shape.heads * lora.shape.head_dim * 2048
    assert reference_flops_per_token(lora) == pytest.approx(forward)

    recipe = yaml.safe_load((REPO / "recipes/qwen2.5-7b/dpo_lora.yaml").read_text())
    del recipe["lora"]
    recipe["preference"]["reference"] = "model"
    path = tmp_path / "dpo_full_live.yaml"
    path.write_text(yaml.safe_dump(recipe))
    full, _ = workload_from_recipe(str(path))
    precomputed = Workload(**{**full.__dict__, "reference": "precomputed"})
    added = model_states_gb(full, "fsdp", 8)[0] - model_states_gb(precomputed, "fsdp", 8)[0]
    assert added == pytest.approx(2 * full.params / 8 / 1e9)  # bf16 copy, an eighth per GPU


def test_the_tp_row_shards_states_over_every_gpu_and_splits_what_attention_and_the_mlp_keep(capsys):
    """--tp T (= --gpus): weights, gradients and Adam states / T, as FSDP2 over the same GPUs; of the 34 bytes per
    token and hidden unit a layer keeps, the 24 of attention and the MLP / T, the 10 of norms and residual whole."""
    from disttrain.metrics.flops import ModelShape
    from disttrain.tools.cost import activations_gb

    shape = ModelShape(params=8e9, matmul_params=8e9, layers=32, heads=32, head_dim=128, hidden=4096, vocab=128256)
    w = Workload(8e9, shape, 1e9, 8192, 1, False, loss_impl="chunked")
    layers = 32 * 8192 * 4096
    assert activations_gb(w) - activations_gb(w, tp=8) == pytest.approx(24 * (1 - 1 / 8) * layers / 1e9)
    main(["--recipe", str(REPO / "recipes/llama-3.1-8b/full_sft_fsdp.yaml"), "--tokens", "1e9", "--gpus", "8",
          "--tp", "8", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["tp"]["states_gb"] == rows["fsdp"]["states_gb"] and rows["tp"]["mfu"] == ASSUMED_MFU["tp"]
    assert rows["tp"]["activations_gb"] < rows["fsdp"]["activations_gb"] == rows["ddp"]["activations_gb"]
    with pytest.raises(DisttrainError, match=r"--tp 3 must divide --gpus 8"):
        main(["--params", "7e9", "--tokens", "1e9", "--gpus", "8", "--tp", "3"])


def test_fsdp_tp_rows_shard_states_over_every_gpu_or_one_replica_and_split_activations_over_tp(capsys):
    """--tp T < --gpus: FSDP2 + TP (fsdp_tp.yaml): each GPU holds 1/GPUs of every weight (1/tp split, then sharded
    over the GPUs / T groups), activations as the tp row's at T; with --hsdp-replicas R the states are sharded
    within a replica (hsdp_tp)."""
    recipe = str(REPO / "recipes/llama-3.1-8b/full_sft_fsdp.yaml")
    main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "16", "--tp", "4", "--hsdp-replicas", "2", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert "tp" not in rows and rows["fsdp_tp"]["states_gb"] == rows["fsdp"]["states_gb"]
    assert rows["hsdp_tp"]["states_gb"] == rows["hsdp"]["states_gb"] == pytest.approx(2 * rows["fsdp"]["states_gb"])
    main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "4", "--tp", "4", "--json"])
    tp_alone = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}["tp"]
    assert rows["fsdp_tp"]["activations_gb"] == rows["hsdp_tp"]["activations_gb"] == tp_alone["activations_gb"]
    assert rows["fsdp_tp"]["activations_gb"] < rows["fsdp"]["activations_gb"]


def test_ep_rows_shard_states_as_fsdp2_and_the_experts_traffic_is_counted_by_hand(capsys):
    """--ep E: fsdp_ep (and with --hsdp-replicas, hsdp_ep) hold what FSDP2 (HSDP) holds per GPU; the traffic per GPU
    and micro-batch, by hand for Qwen3-30B-A3B's full recipe (4096 tokens, 8 of 128 experts, hidden 2048, 48
    layers, gradient checkpointing: 3 weight gathers, 6 token exchanges): FSDP2 gathers 3 x 2 bytes and reduces 4
    bytes of every expert weight over 7/8 of the GPUs; EP sends 6 x 4096 x 8 x 2048 x 2 bytes x 48 layers x 7/8."""
    from disttrain.tools.cost import expert_traffic_gb, workload_from_recipe

    recipe = str(REPO / "recipes/qwen3-30b-a3b/full_sft_ep.yaml")
    main(["--recipe", recipe, "--tokens", "1e8", "--gpus", "16", "--ep", "8", "--hsdp-replicas", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["fsdp_ep"]["states_gb"] == rows["fsdp"]["states_gb"]
    assert rows["hsdp_ep"]["states_gb"] == rows["hsdp"]["states_gb"]
    w, _ = workload_from_recipe(recipe)
    experts = w.shape.expert_params
    traffic = expert_traffic_gb(w, 8, 8)
    assert traffic["fsdp_gb"] == pytest.approx((3 * 2 + 4) * experts * 7 / 8 / 1e9)
    assert traffic["ep_tokens_gb"] == pytest.approx(6 * 4096 * 8 * 2048 * 2 * 48 * 7 / 8 / 1e9)
    assert traffic["ep_gather_gb"] == 0  # each expert whole on one GPU
    assert expert_traffic_gb(w, 16, 8)["ep_gather_gb"] == pytest.approx((3 * 2 + 4) * experts / 8 / 2 / 1e9)
    assert result["expert_traffic"] == expert_traffic_gb(w, 16, 8, 2)
    with pytest.raises(DisttrainError, match="--ep 3 must divide the GPUs of a replica"):
        main(["--recipe", recipe, "--tokens", "1e8", "--gpus", "8", "--ep", "3"])


def test_the_pp_row_shards_states_as_fsdp2_and_pays_the_bubble_in_time(capsys):
    """--pp P: fsdp_pp holds FSDP2's states per GPU; 1F1B's first stage keeps 1/P of the layers' activations for
    min(P, grad_accum) micro-batches; the time is FSDP2's at the same MFU over 1 - (P - 1) / (m + P - 1), by hand
    for the 32B recipe (grad_accum 8: 1/9 of each step idle at P 2)."""
    recipe = str(REPO / "recipes/qwen2.5-32b/full_sft_hsdp.yaml")
    main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "16", "--pp", "2", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["fsdp_pp"]["states_gb"] == rows["fsdp"]["states_gb"]
    assert rows["fsdp_pp"]["activations_gb"] == pytest.approx(rows["fsdp"]["activations_gb"] * 2 / 2)
    assert rows["fsdp_pp"]["hours"] == pytest.approx(rows["fsdp"]["hours"] / (1 - 1 / 9))
    main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "16", "--pp", "4", "--grad-accum", "2", "--json"])
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["fsdp_pp"]["activations_gb"] == pytest.approx(rows["fsdp"]["activations_gb"] * 2 / 4)
    assert rows["fsdp_pp"]["hours"] == pytest.approx(rows["fsdp"]["hours"] / (1 - 3 / 5))
    main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "16", "--pp", "2"])
    assert "the bubble idles 11% of each step" in capsys.readouterr().out
    with pytest.raises(DisttrainError, match="--pp 3 must divide --gpus 16"):
        main(["--recipe", recipe, "--tokens", "1e9", "--gpus", "16", "--pp", "3"])


def test_a_plan_that_fits_only_tightly_is_not_recommended_over_one_with_room(capsys):
    """Qwen3-30B-A3B LoRA on 8 x H100: DDP's replicas need 74.6 of 80 GB (fits the allocator, 1.4 GB left);
    the planner recommended it while the recipe's comment called it too tight. Now: FSDP2, with room."""
    main(["--recipe", str(REPO / "recipes/qwen3-30b-a3b/lora_sft.yaml"), "--tokens", "1e8", "--gpu", "H100",
          "--gpus", "8", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["ddp"]["fits"] and rows["ddp"]["tight"] and not rows["fsdp"]["tight"]
    assert result["recommended"] == "fsdp"


def test_online_rl_plans_its_sequences_and_rollouts_and_times_decoding_only_at_a_given_rate(capsys):
    """A GRPO recipe: a micro-batch is micro_batch_size x num_generations sequences of prompt + completion; the
    rollouts' forward passes (sampling, the reference with beta > 0; the old policy with num_iterations > 1) are
    counted once per num_iterations steps; decoding is timed only at the rate given."""
    from disttrain.metrics.flops import forward_flops_per_token
    from disttrain.tools.cost import rollout_flops_per_token, workload_from_recipe

    w, title = workload_from_recipe(str(REPO / "recipes/qwen2.5-7b/grpo_lora.yaml"))  # beta 0.04, 1 iteration
    assert (w.seq_len, w.micro_batch) == (512 + 768, 1 * 8) and w.reference == "adapters" and "GRPO" in title
    assert w.rollout_forwards == 2.0  # sampling + the adapters-off reference
    assert rollout_flops_per_token(w) == pytest.approx(2 * forward_flops_per_token(w.shape, w.seq_len))
    runs = {}
    for extra in ([], ["--decode-tokens-per-s", "500"]):
        main(["--recipe", str(REPO / "recipes/qwen2.5-7b/grpo_lora.yaml"), "--tokens", "1e8", "--gpus", "8",
              "--json", *extra])
        runs[bool(extra)] = {r["strategy"]: r["hours"] for r in json.loads(capsys.readouterr().out)["rows"]}
    generated = 1e8 * 768 / (512 + 768)
    assert runs[True]["ddp"] - runs[False]["ddp"] == pytest.approx(generated / (8 * 500) / 3600)

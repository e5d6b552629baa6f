"""Real `accelerate launch` runs with 2 CPU processes (DDP over gloo), exactly as users launch them."""

import json
from collections import Counter

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics
from strategy_runs import strategy_run

pytestmark = pytest.mark.launch


def test_ranks_get_disjoint_shards_reshuffled_per_epoch(tmp_path, tiny_model_dir):
    out = tmp_path / "probe"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, out, training={"micro_batch_size": 8}))
    assert_ok(launch("ddp", recipe, script="tests/scripts/shard_probe.py"))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 and "MULTI_CPU" in r["type"] for r in ranks)
    dataset = Counter(map(tuple, ranks[0]["dataset"]))  # the data has duplicate rows: compare multisets
    for epoch in ("0", "1"):
        a, b = (Counter(map(tuple, r["epochs"][epoch])) for r in ranks)
        assert a.total() == b.total() == 1000  # 2000 rows / 2 ranks, batches of 8 (drop_last)
        assert not (a + b) - dataset, "a row was given to both ranks"
    # per-epoch reshuffle: same rank, different order in epoch 1
    assert ranks[0]["epochs"]["0"][:20] != ranks[0]["epochs"]["1"][:20]


def test_a_mixture_gives_every_rank_the_same_rows_in_disjoint_shards(tmp_path, tiny_model_dir):
    """The mixture is built from the seed on the main process (the others read the cache): the same
    dataset on every rank, dealt out without overlap."""
    out = tmp_path / "probe"
    sources = [{"path": str(REPO / "data/tiny_alpaca.jsonl"), "format": "alpaca", "weight": 2},
               {"path": str(REPO / "data/tiny_sharegpt.jsonl"), "format": "sharegpt", "weight": 1}]
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"micro_batch_size": 8},
        data={"path": None, "format": None, "sources": sources, "max_seq_len": 256}))
    assert_ok(launch("ddp", recipe, script="tests/scripts/shard_probe.py"))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["dataset"] == ranks[1]["dataset"] and len(ranks[0]["dataset"]) > 2000
    dataset = Counter(map(tuple, ranks[0]["dataset"]))
    a, b = (Counter(map(tuple, r["epochs"]["0"])) for r in ranks)
    assert not (a + b) - dataset, "a row was given to both ranks"


def test_ddp_trains_logs_and_exports_a_loadable_model(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out,
        training={"max_steps": 12, "lr_scheduler": "cosine", "warmup_steps": 3, "lr": 3e-3, "eval_every": 6},
        logging={"every_steps": 2}))
    proc = launch("ddp", recipe, overrides=["data.eval_fraction=0.05"])
    assert_ok(proc)
    assert "processes=2" in proc.stdout and "MULTI_CPU" in proc.stdout

    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in evals] == [6, 12]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, "loss did not fall"
    from disttrain.metrics.flops import shape_from_config
    from transformers import AutoConfig
    dense = 6 * shape_from_config(AutoConfig.from_pretrained(tiny_model_dir)).matmul_params
    for r in train:
        # model FLOPs: at least the dense part for the tokens processed (attention adds a little)
        flops = r["tflops_per_device"] * 1e12 * r["step_time_s"] * 2 * 2  # 2 steps per line, 2 devices
        assert dense * r["tokens"] <= flops * 1.001 < dense * r["tokens"] * 1.5
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops_per_device"])
        assert 0 < r["data_wait_share"] < 1 and r["peak_mem_gb"] > 0
        assert r["tokens_per_s_per_device"] <= r["padded_tokens_per_s_per_device"]
        assert r["loss_rank_min"] <= r["loss"] <= r["loss_rank_max"]
        assert r["loss_rank_min"] < r["loss_rank_max"]  # different data on each rank
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0

    # the scheduler stepped once per optimizer step, not once per process
    from transformers import get_scheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    sched = get_scheduler("cosine", opt, num_warmup_steps=3, num_training_steps=12)
    expected = []
    for _ in range(12):
        opt.step()
        sched.step()
        expected.append(sched.get_last_lr()[0])
    assert [r["lr"] for r in train] == pytest.approx([expected[s - 1] for s in (2, 4, 6, 8, 10, 12)])

    # the exported dir is a standard HF model that loads and generates
    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = out / "final"
    assert (final / "model.safetensors").is_file() and not (out / "final.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat the words.\n\napple river"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    # saved weights differ from the initial model (it trained) and match nothing random
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(initial.lm_head.weight, model.lm_head.weight)
    assert (out / "recipe.yaml").is_file()


def test_bad_data_line_fails_fast_with_file_and_line(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "outptu": "b"}\n')
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out",
                                                           data={"path": str(bad)}))
    proc = launch("ddp", recipe, timeout=180)
    assert proc.returncode != 0
    assert f"error: {bad}:2: missing field 'output' required by data.format=alpaca" in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


def test_lora_export_with_merged_model(runs, tiny_model_dir):
    """The strategy matrix's DDP LoRA run (lora.merge_on_export: true): the adapter and the merged model give
    the same logits, and they differ from the base model's; merged/ is a model dir of its own (its tokenizer)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = strategy_run(runs, tiny_model_dir, "ddp", True).out / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(final / "merged").chat_template == AutoTokenizer.from_pretrained(
        final).chat_template is not None
    adapter = AutoPeftModelForCausalLM.from_pretrained(final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    ids = torch.tensor([[5, 17, 42, 9, 100]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-5, rtol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        assert not torch.allclose(base(ids).logits, merged(ids).logits, atol=1e-4)  # the adapter learned something

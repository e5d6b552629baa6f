"""The knobs users expect from other repos, each validated and working: LoRA variants (DoRA, rsLoRA, init,
per-module ranks), NEFTune, mlflow tracking, push_to_hub (everything up to the upload: the Hub is unreachable)."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, held_out, launch, write_recipe
from disttrain.model import hub
from disttrain.recipe.compat import check_trackers
from disttrain.recipe.schema import LoraSection, load_recipe
from disttrain.errors import DisttrainError, RecipeError
from disttrain.metrics.log import read_metrics


def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_lora_variants_reach_peft(tiny_model_dir):
    from disttrain.model.loading import apply_lora

    model = apply_lora(tiny(tiny_model_dir), LoraSection(r=4, alpha=8, target_modules=["q_proj", "down_proj"],
                                                         use_dora=True, use_rslora=True,
                                                         rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 4}),
                       gradient_checkpointing=False)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    down = model.base_model.model.model.layers[0].mlp.down_proj
    assert "default" in q.lora_magnitude_vector  # DoRA's magnitude
    assert q.scaling["default"] == pytest.approx(8 / 4 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    assert down.lora_A["default"].weight.shape[0] == 2 and down.scaling["default"] == pytest.approx(4 / 2 ** 0.5)
    gauss = apply_lora(tiny(tiny_model_dir), LoraSection(r=4, target_modules=["q_proj"], init_lora_weights="gaussian"),
                       gradient_checkpointing=False)
    layer = gauss.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0  # still a no-op at the start
    with pytest.raises(RecipeError, match="init_lora_weights"):
        load_recipe(REPO / "recipes/tiny/sft.yaml", ["lora.init_lora_weights=pissa"])


def test_neftune_adds_noise_only_in_training(tiny_model_dir):
    from transformers.integrations.neftune import activate_neftune

    model = tiny(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    clean = model.get_input_embeddings()(ids)
    activate_neftune(model, 5.0)
    model.train()
    noisy = model.get_input_embeddings()(ids)
    bound = 5.0 / (4 * clean.shape[-1]) ** 0.5
    assert 0 < (noisy - clean).abs().max() <= bound + 1e-6
    model.eval()
    assert torch.equal(model.get_input_embeddings()(ids), clean)
    with pytest.raises(RecipeError, match="neftune_alpha"):
        load_recipe(REPO / "recipes/tiny/sft.yaml", ["training.neftune_alpha=0"])


@pytest.mark.parametrize("parts", [2, 8])
def test_neftune_on_a_slice_of_the_sequence_draws_the_whole_sequences_noise(tiny_model_dir, parts):
    """Under Ulysses (sp) or context parallelism (cp) each process embeds 1/parts of every sequence; the noise must
    be what one process draws for the whole sequence, alpha / sqrt(length x hidden), not sqrt(parts) times it (2.8x
    at the 64k recipe's cp=8). Uniform noise: every draw within the bound, the largest of >= 8,000 within 1% of it."""
    from disttrain.model.loading import add_embedding_noise

    def largest_noise(ids, sequence_parts):
        model = tiny(tiny_model_dir)
        clean = model.get_input_embeddings()(ids)
        add_embedding_noise(model, 5.0, None, sequence_parts)
        model.train()
        return (model.get_input_embeddings()(ids) - clean).abs().max().item()

    length = 64
    whole = (torch.arange(16 * length).reshape(16, length) * 7) % 300 + 5  # 16 rows: >= 8,000 draws a slice
    hidden = tiny(tiny_model_dir).config.hidden_size
    bound = 5.0 / (length * hidden) ** 0.5  # one process, the whole sequence
    one_process = largest_noise(whole, 1)
    on_a_slice = largest_noise(whole[:, :length // parts], parts)
    assert 0.99 * bound < one_process <= bound + 1e-6
    assert 0.99 * bound < on_a_slice <= bound + 1e-6  # before: sqrt(parts) x bound


@pytest.mark.launch
def test_dora_rslora_neftune_and_mlflow_under_fsdp(tmp_path, tiny_model_dir):
    """One FSDP2 launch: DoRA + rsLoRA adapters and NEFTune train and export; logging.report_to=[mlflow] goes
    through accelerate's tracker to a local store: the recipe as params, every logged loss as a metric, the
    sample generations of each evaluation as Markdown artifacts."""
    import json
    import os

    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"max_steps": 4, "neftune_alpha": 5.0, "eval_every": 2},
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_dora": True, "use_rslora": True},
        data={"eval_path": str(held_out(tmp_path))},
        logging={"report_to": ["mlflow"], "every_steps": 1, "run_name": "knobs", "samples": 2}))
    store = tmp_path / "mlruns"
    # mlflow >= 3 keeps a local file store only on request (its default is an sqlite database)
    env = {"MLFLOW_TRACKING_URI": store.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    assert_ok(launch("fsdp", recipe, env=env))

    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["use_dora"] and config["use_rslora"]

    os.environ.update(env)
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=store.as_uri())
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.run_name == "knobs" and run.data.params["training.neftune_alpha"] == "5.0"
        logged = [r for r in read_metrics(out) if "loss" in r]
        history = client.get_metric_history(run.info.run_id, "loss")
        assert [m.step for m in history] == [r["step"] for r in logged] == [1, 2, 3, 4]
        assert [m.value for m in history] == pytest.approx([r["loss"] for r in logged])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [2, 4]
        artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
        assert artifacts == ["samples/step-000002.md", "samples/step-000004.md"]
        text = client.download_artifacts(run.info.run_id, "samples/step-000004.md", str(tmp_path))
        assert open(text).read().startswith("| prompt | completion |")
    finally:
        for key in env:
            os.environ.pop(key)


def test_mlflow_missing_is_one_clear_line(monkeypatch):
    import importlib.util

    recipe = load_recipe(REPO / "recipes/tiny/sft.yaml", ["logging.report_to=[mlflow]"])
    assert recipe.logging.report_to == ["mlflow"]
    check_trackers(["mlflow"])  # installed by the test extra
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(DisttrainError, match=r"mlflow but it is not installed: pip install mlflow \(or `make setup "
                                             r"EXTRAS=test,mlflow`\)"):
        check_trackers(["mlflow"])


class FakeApi:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        if self.fail:
            raise ConnectionError("Hub unreachable")
        self.calls.append(("upload_folder", kwargs))


def test_push_to_hub_checks_the_token_first_and_uploads_the_final_dir(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="is not a Hub repo id"):
        load_recipe(REPO / "recipes/tiny/sft.yaml", ["output.push_to_hub=just-a-name"])
    with pytest.raises(RecipeError, match="needs output.save_final_model: true"):
        load_recipe(REPO / "recipes/tiny/sft.yaml", ["output.push_to_hub=me/model", "output.save_final_model=false"])
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored login either
    with pytest.raises(DisttrainError, match="no Hugging Face token; set HF_TOKEN"):
        hub.check_token("me/model")
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    hub.check_token("me/model")
    api = FakeApi()
    assert hub.push(tmp_path, "me/model", api) == "https://huggingface.co/me/model"
    assert api.calls[0] == ("create_repo", "me/model", {"private": True, "exist_ok": True})
    assert api.calls[1][1]["folder_path"] == str(tmp_path) and api.calls[1][1]["repo_id"] == "me/model"
    with pytest.raises(DisttrainError,
                       match=r"upload failed \(ConnectionError: Hub unreachable\).*huggingface-cli upload"):
        hub.push(tmp_path, "me/model", FakeApi(fail=True))


@pytest.mark.launch
def test_a_missing_token_stops_the_run_before_training(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, out,
                                                           output={"push_to_hub": "me/model"}))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", str(recipe)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **env})
    assert proc.returncode != 0
    assert "error: output.push_to_hub=me/model: no Hugging Face token" in proc.stderr
    assert not (out / "metrics.jsonl").exists()  # nothing trained

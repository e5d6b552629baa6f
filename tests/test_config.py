import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_recipe, write_recipe
from disttrain.recipe.schema import load_recipe, parse_override
from disttrain.errors import RecipeError


@pytest.fixture
def recipe_file(tmp_path, tiny_model_dir):
    return write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out"))


def test_loads_and_applies_typed_overrides(recipe_file):
    recipe = load_recipe(recipe_file, ["training.lr=1e-4", "data.packing=true", "lora.r=4",
                                       "logging.report_to=[tensorboard]"])
    assert recipe.training.lr == 1e-4
    assert recipe.data.packing is True
    assert recipe.lora is not None and recipe.lora.r == 4 and recipe.lora.alpha == 32
    assert recipe.logging.report_to == ["tensorboard"]
    assert recipe.model.trust_remote_code is False  # only when a recipe asks
    assert load_recipe(recipe_file, ["training.mixed_precision=no"]).training.mixed_precision == "no"


def test_every_shipped_recipe_parses():
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        # local paths (tiny model) may be unbuilt in a fresh checkout; everything else must validate
        try:
            load_recipe(path)
        except RecipeError as exc:
            assert "make tiny" in str(exc), f"{path}: {exc}"


def test_every_shipped_recipe_states_its_checkpoint_cadence():
    """A multi-hour run that crashes must not lose everything: each shipped recipe says how often it saves
    (in its own file, not by the schema's default), and a time cadence is on unless the recipe turns it off."""
    import yaml

    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        output = yaml.safe_load(path.read_text())["output"]
        assert "checkpoint_minutes" in output, f"{path}: output.checkpoint_minutes is not stated"
        assert output["checkpoint_minutes"] or output.get("checkpoint_every"), f"{path}: no checkpoint cadence"
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", ["output.checkpoint_minutes=null"]).output.checkpoint_minutes \
        is None


@pytest.mark.parametrize("override, needle", [
    ("training.lrr=1", "training.lrr (set on the command line): unknown key"),
    ("training.lr=fast", "training.lr (set on the command line): Input should be a valid number"),
    ("training.micro_batch_size=0",
     "training.micro_batch_size (set on the command line): Input should be greater than or equal to 1"),
    ("data.format=csv",
     "data.format (set on the command line): Input should be 'alpaca', 'chat', 'sharegpt', 'text', 'preference', "
     "'unpaired' or 'prompt'"),
    ("data.path=missing.jsonl", "data.path: data file 'missing.jsonl' not found"),
])
def test_bad_values_name_the_key_and_the_file(recipe_file, override, needle):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_file, [override])
    assert str(err.value).startswith(str(recipe_file))
    assert needle in str(err.value)


def test_unknown_key_in_file(tmp_path, tiny_model_dir):
    recipe = base_recipe(tiny_model_dir, tmp_path / "out", training={"epocs": 3})
    path = write_recipe(tmp_path / "typo.yaml", recipe)
    with pytest.raises(RecipeError, match=r"typo.yaml: training.epocs: unknown key"):
        load_recipe(path)


def test_missing_section_and_yaml_syntax_line(tmp_path):
    path = tmp_path / "empty_model.yaml"
    path.write_text("data: {path: x.jsonl, format: alpaca}\noutput: {dir: o}\n")
    with pytest.raises(RecipeError, match="model: Field required"):
        load_recipe(path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  name_or_path: x\ndata: [unclosed\n")
    with pytest.raises(RecipeError, match=r"broken.yaml:\d+: invalid YAML"):
        load_recipe(broken)


def test_override_syntax():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=null") == ("a", None)
    with pytest.raises(RecipeError, match="expected key.path=value"):
        parse_override("training.lr")


def test_cli_bad_recipe_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, out))
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", str(path), "training.lr=abc"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "training.lr" in lines[0], proc.stderr
    assert not out.exists()


def test_setup_installs_again_when_its_arguments_change():
    """`make train` first (the CPU build), then `make setup TORCH_SPEC=torch EXTRAS=test,tracking` for the GPU:
    make answered "Nothing to be done" (the stamp depended on pyproject.toml only) and the CPU torch stayed."""
    import subprocess

    from conftest import REPO

    def dry_run(*variables):
        return subprocess.run(["make", "-n", "setup", *variables], cwd=REPO, capture_output=True, text=True,
                              timeout=60).stdout

    assert "pip install" not in dry_run()  # installed with these arguments already (make setup ran first)
    again = dry_run("TORCH_SPEC=torch", "EXTRAS=test,tracking")
    assert "pip install -q torch " in again and 'pip install -q -e ".[test,tracking]"' in again
    assert "setup: installing torch: torch, extras: [test,tracking]" in again
    # after installing, setup checks the build suits the machine: GPU=1 (or nvidia-smi's GPUs) wants CUDA
    assert "disttrain.tools.doctor --torch-build --expect-gpu" in dry_run("TORCH_SPEC=torch", "GPU=1")
    assert "disttrain.tools.doctor --torch-build" in [" ".join(line.split()[-2:]) for line in
                                                      dry_run("TORCH_SPEC=torch", "GPU=0").splitlines()]


def test_a_plain_make_keeps_what_the_last_setup_installed(tmp_path):
    """After `make setup EXTRAS=test,tracking`, a plain `make train` or `make test` (default EXTRAS) must not
    install again with the defaults (minutes each time, and the trackers' extra seemingly lost)."""
    import re
    import subprocess

    from conftest import REPO

    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "install-args.mk").write_text("TORCH_SPEC ?= torch==2.13.0\nTORCH_INDEX ?= \nEXTRAS ?= test,tracking\n")

    def dry_run(*variables):
        return subprocess.run(["make", "-n", "setup", f"VENV={venv}", *variables], cwd=REPO, capture_output=True,
                              text=True, timeout=60).stdout

    stamp = re.search(r"> (\S+/\.installed-\d+)$", dry_run(), re.M).group(1)
    assert "extras: [test,tracking]" in dry_run()  # the recorded arguments, not the Makefile's defaults
    Path(stamp).write_text("torch: torch==2.13.0, extras: [test,tracking]\n")
    assert "pip install" not in dry_run()
    assert 'pip install -q -e ".[test]"' in dry_run("EXTRAS=test")  # asked for anew: installs again


def test_lora_on_lm_head_with_the_chunked_loss_is_one_line_before_anything_loads():
    """It was a TypeError traceback after the model loaded (the chunked loss reads lm_head as a plain Linear)."""
    from conftest import REPO
    from disttrain.errors import RecipeError
    from disttrain.recipe.schema import load_recipe

    for override in ("lora.target_modules=[q_proj,lm_head]", "lora.modules_to_save=[lm_head]"):
        with pytest.raises(RecipeError, match="lora adapts lm_head, which training.loss_impl=chunked") as err:
            load_recipe(REPO / "recipes/tiny/sft.yaml", ["lora.r=4", override])
        assert "\n" not in str(err.value)
    load_recipe(REPO / "recipes/tiny/sft.yaml", ["lora.r=4", "lora.target_modules=[q_proj,lm_head]",
                                                 "training.loss_impl=plain"])

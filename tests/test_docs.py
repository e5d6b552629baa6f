"""The docs stay true: every command they show runs as written (tests/docs_commands.py), and the generated
parts (the recipe field reference, the compatibility matrix: tests/test_matrix.py) equal what generates them."""

import json

import pytest

from docs_commands import DOCS, Repo, check, commands_in
from disttrain.recipe import reference


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo.read()


def test_every_command_in_the_docs_runs_as_written(repo):
    commands = [command for page in DOCS for command in commands_in(page)]
    assert len(commands) > 200 and {c.page for c in commands} >= {"README.md", "docs/strategies.md"}
    problems = check(commands, repo)
    assert not problems, "\n".join(map(str, problems))


BROKEN = """
Commands a user would copy, each broken as the docs once were:

```bash
make cost --bench bench/results.json
make diagnose outputs/tiny-sft/ddp-2
make trian
make train TRAIN_STEPS=3
make train ARGS='training.lrr=1'
make cost ARGS='--recipe recipes/tiny/sft.yaml --gpuz H100'
python -m disttrain.tools.nope
.venv/bin/python train.py --recipe recipes/tiny/nope.yaml
accelerate launch --config_file accelerate_configs/nope.yaml train.py --recipe recipes/tiny/sft.yaml
accelerate launch --confg accelerate_configs/ddp.yaml train.py --recipe recipes/tiny/sft.yaml
make preflight RECIPE=recipes/mistral-7b/lora_sft.yaml
python -c "from disttrain.data import tokenize_recrd"
STRATEGY=hsdp RECIPE=recipes/nope.yaml sbatch --nodes=2 scripts/slurm/nope.sbatch
```

And inline: `make report RUN=outputs/a` is fine, `make bench-memory ARGS='training.compile=true'` is not,
nor is `python -m disttrain.tools.cost --params 7e9 --gpu-count
8`.
"""

EXPECTED = [
    "make does not take --bench: a program's flags go in ARGS='--bench ...'",
    "no make target 'bench/results.json' (make reads a bare word as a target: give it as VAR=value)",
    "no make target 'outputs/tiny-sft/ddp-2' (make reads a bare word as a target: give it as VAR=value)",
    "no make target 'trian'",
    "make variable TRAIN_STEPS is read by neither the Makefile nor the code",
    "no recipe field training.lrr",
    "disttrain.tools.cost has no option --gpuz",
    "no module disttrain.tools.nope",
    "no such file or directory: recipes/tiny/nope.yaml",
    "no config file accelerate_configs/nope.yaml",
    "accelerate launch has no option --confg",
    "no such file or directory: recipes/mistral-7b/lora_sft.yaml",
    "disttrain.data has no tokenize_recrd",
    "no such file or directory: recipes/nope.yaml",
    "no such file or directory: scripts/slurm/nope.sbatch",
    "disttrain.bench.memory: unrecognized arguments: training.compile=true",
    "disttrain.tools.cost has no option --gpu-count",
]


def test_a_broken_command_is_named_with_its_page_line_and_what_is_wrong(repo, tmp_path):
    page = tmp_path / "broken.md"
    page.write_text(BROKEN)
    problems = check(commands_in(page), repo)
    assert [p.what for p in problems] == EXPECTED, "\n".join(map(str, problems))
    assert str(problems[0]) == "broken.md:5: `make cost --bench bench/results.json`: " + EXPECTED[0]
    assert str(problems[-1]).startswith("broken.md:21: `python -m disttrain.tools.cost --params 7e9 --gpu-count 8`")


def test_a_command_made_true_by_an_earlier_one_on_the_page_passes(repo, tmp_path):
    page = tmp_path / "ok.md"
    page.write_text("`mkdir -p recipes/mine && cp recipes/tiny/sft.yaml recipes/mine/sft.yaml`, then "
                    "`make preflight RECIPE=recipes/mine/sft.yaml STRATEGY=zero3`.\n")
    assert check(commands_in(page), repo) == []


def test_the_recipe_field_reference_is_generated_from_the_schema():
    assert reference.DOC.read_text() == reference.rendered(reference.DOC.read_text()), "run `make docs`"
    from disttrain.recipe.schema import Recipe
    fields = [f"{section}.{name}" for section, info in Recipe.model_fields.items()
              for name in reference._section_class(info.annotation).model_fields]
    missing = [f for f in fields if f"`{f}`" not in reference.DOC.read_text()]
    assert not missing and len(fields) > 90, missing


def test_the_gpu_acceptance_items_in_the_docs_are_the_scripts_items(tmp_path):
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    copy = tmp_path / "gpu.md"
    shutil.copy(REPO / "docs/gpu.md", copy)
    subprocess.run([sys.executable, str(REPO / "scripts/gpu/acceptance.py"), "--write-docs", str(copy)], check=True,
                   cwd=REPO, timeout=120)
    assert copy.read_text() == (REPO / "docs/gpu.md").read_text(), "run `make docs`"
    rows = [line for line in copy.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) > 25 and all(line.split(" | ")[1].strip() for line in rows)  # every item says what it checks


# what the shipped recipes' "suggested strategy" column (docs/recipes.md) calls each config
SHOWN_AS = {"ddp": "DDP", "fsdp": "FSDP2", "zero1": "ZeRO-1", "zero3": "ZeRO-3", "hsdp": "HSDP",
            "zero3_ulysses": "Ulysses", "fsdp_cp": "context parallelism",
            "fsdp_ep": "expert parallelism"}
# what they buy (locality, sequence, traffic) is not priced
MESHES = ("hsdp", "zero3_ulysses", "fsdp_cp", "tp", "fsdp_tp", "fsdp_ep")


def test_strategy_advice_agrees_between_recipe_readme_planner_and_slurm(capsys):
    """Each shipped recipe launches (the first `make train-*` of its header) with a strategy that `make cost`
    finds fitting with room on the hardware of that line, at most 10% dearer than the planner's pick (mesh
    strategies: fitting; the planner does not price what they buy); the shipped-recipes table (docs/recipes.md)
    suggests that strategy;
    SLURM's default strategy is the default recipe's."""
    import re
    import shlex

    from conftest import REPO
    from disttrain.tools.cost import main

    shipped = (REPO / "docs/recipes.md").read_text()  # its "Shipped recipes" table (the README links to it)
    suggested = dict(re.findall(r"^\| `(recipes/[^`]+)` \| [^|]+ \| ([^|]+) \|$", shipped, re.M))
    checked = []
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
        launch = re.search(r"make train-([a-z0-9-]+) (?:NODES=(\d+) )?GPUS=(\d+)", header)
        if path.parent.name == "tiny":
            continue
        name = str(path.relative_to(REPO))
        assert launch, f"{name}: its header shows no `make train-<strategy> GPUS=N` line"
        strategy, gpus = launch.group(1).replace("-", "_"), int(launch.group(3)) * int(launch.group(2) or 1)
        planned = re.search(r"make cost ARGS='([^']+)'", header)
        args = shlex.split(planned.group(1)) if planned else ["--recipe", name, "--gpus", str(gpus)]
        args += [] if "--tokens" in args else ["--tokens", "1e8"]
        args += [] if "--gpu" in args else ["--gpu", "H100"]
        main([*args, "--json"])
        result = json.loads(capsys.readouterr().out)
        rows = {r["strategy"]: r for r in result["rows"]}
        assert strategy in rows and rows[strategy]["fits"], f"{name}: {strategy} does not fit its own plan"
        if strategy not in MESHES:
            pick = rows[result["recommended"]]
            assert not rows[strategy]["tight"] and rows[strategy]["cost"] <= 1.1 * pick["cost"], \
                f"{name}: launches {strategy}, `make cost` recommends {pick['strategy']}"
        assert SHOWN_AS[strategy] in suggested[name], f"docs/recipes.md suggests {suggested[name]!r} for {name}"
        checked.append(name)
    assert len(checked) == 23
    sbatch = (REPO / "scripts/slurm/train.sbatch").read_text()
    default = re.search(r"STRATEGY=\$\{STRATEGY:-(\w+)\}", sbatch).group(1), \
        re.search(r"RECIPE=\$\{RECIPE:-(\S+)\}", sbatch).group(1)
    assert f"make train-{default[0]} " in (REPO / default[1]).read_text()


def test_the_loss_memory_figures_quoted_in_the_docs_are_the_benchmark_tables():
    """docs/loss.md and benchmarks.md's prose quote ranges read off benchmarks.md's `make bench-memory` table: they
    are recomputed from it here, so a new table with old prose fails (it did: 9–23× stayed after a re-run)."""
    import re

    from conftest import REPO

    bench = (REPO / "docs/benchmarks.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (plain|chunked|trl) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \|",
                      bench.replace("| - |", "| 1x |"), re.M)
    table = {(strategy, engine): (float(share), float(step), float(cut)) for strategy, engine, share, cut, step in rows}
    strategies = sorted({s for s, _ in table})
    assert len(strategies) == 4 and len(table) == 12

    def quoted(values) -> str:
        return f"{min(values):.2g}–{max(values):.2g}×"

    reduction = quoted([table[s, "chunked"][2] for s in strategies])  # the table's own column (unrounded shares)
    versus_trl = quoted([table[s, "trl"][0] / table[s, "chunked"][0] for s in strategies])
    faster = quoted([table[s, "trl"][1] / table[s, "chunked"][1] for s in strategies])
    loss = " ".join((REPO / "docs/loss.md").read_text().split())
    assert f"peak memory {reduction} smaller" in loss and f"{versus_trl} less loss memory" in loss
    assert f"steps {faster} faster" in loss
    assert f"share of peak memory is {reduction} smaller" in " ".join(bench.split())

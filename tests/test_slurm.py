"""scripts/slurm/train.sbatch renders, for every shipped config, the launch line the Make targets run: the same
config, processes, machines and mesh flags (HSDP, Ulysses, CP, TP, FSDP2 + TP), which it takes from the one
definition in the Makefile (`make mesh-flags`). Before, it passed no mesh flags, so every mesh config (the
shipped 2-node HSDP recipe included) was refused."""

import os
import re
import subprocess

import pytest

from conftest import REPO

# config -> its make target (the configs a multi-node job runs: every one but the single process)
TARGETS = {config: "train-" + config.replace("_", "-") for config in
           ("ddp", "fsdp", "fsdp_offload", "hsdp", "fsdp_cp", "tp", "fsdp_tp", "zero1", "zero2", "zero3",
            "zero3_offload", "zero3_ulysses")}
FLAGS = re.compile(r"--(config_file|num_processes|num_machines|machine_rank|parallelism_config_\w+)[ =](\S+)")


def _arithmetic(line: str) -> str:
    """make -n prints the shell's $(( ... )) unevaluated: evaluate them as the shell would (integers)."""
    return re.sub(r"\$\(\(\s*([\d\s*/+-]+?)\s*\)\)", lambda m: str(int(eval(m.group(1).replace("/", "//")))), line)


def _flags(line: str) -> dict[str, str]:
    return {name: value for name, value in FLAGS.findall(line)}


@pytest.mark.parametrize("config", list(TARGETS))
def test_the_sbatch_line_is_the_make_targets_line(config):
    env = {**os.environ, "SLURM_NNODES": "2", "MASTER_ADDR": "10.0.0.1", "GPUS_PER_NODE": "4", "STRATEGY": config,
           "DRY_RUN": "1", "RECIPE": "recipes/qwen2.5-32b/full_sft_hsdp.yaml"}
    rendered = subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    nodes = rendered.stdout.strip().splitlines()
    assert len(nodes) == 2 and all("recipes/qwen2.5-32b/full_sft_hsdp.yaml" in line for line in nodes)
    make = subprocess.run(["make", "-n", TARGETS[config], "NODES=2", "GPUS=4", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    launch = next(line for line in make.stdout.splitlines() if "launch --config_file" in line)
    expected = _flags(_arithmetic(launch))
    ours = _flags(nodes[1])
    expected["config_file"] = os.path.relpath(expected["config_file"], REPO) if os.path.isabs(expected["config_file"]) \
        else expected["config_file"]
    assert ours == expected
    if config in ("hsdp", "fsdp_cp", "tp", "fsdp_tp", "zero3_ulysses"):
        assert any(name.startswith("parallelism_config_") for name in ours)


def test_the_log_dir_slurm_writes_to_ships_with_the_repository():
    """SLURM opens #SBATCH --output before the script runs, so logs/ must exist at submission."""
    text = (REPO / "scripts/slurm/train.sbatch").read_text()
    assert "#SBATCH --output=logs/" in text
    tracked = subprocess.run(["git", "ls-files", "logs"], cwd=REPO, capture_output=True, text=True).stdout
    assert "logs/.gitkeep" in tracked

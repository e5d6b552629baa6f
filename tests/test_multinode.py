"""Two "nodes" on one machine: two `make train-<strategy> NODES=2 NODE_RANK=r` launches on loopback, one
process each, exactly the per-node commands a cluster runs. Results must equal a one-node run with the
same global batch."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, base_recipe, free_port, write_recipe
from strategy_runs import matrix_recipe, small_data, strategy_run
from disttrain.tools.diagnose import diagnose
from disttrain.metrics.log import read_metrics

pytestmark = pytest.mark.launch


def make_node(strategy, rank, port, recipe, timeout_s=120):
    """Output goes to files: a node blocked on a full pipe would stall the other node's collectives."""
    cmd = ["make", "-s", f"train-{strategy}", "NODES=2", f"NODE_RANK={rank}", "GPUS=1", "MASTER_ADDR=127.0.0.1",
           f"MASTER_PORT={port}", f"RDZV_TIMEOUT={timeout_s}", f"RECIPE={recipe}"]
    log = Path(recipe).with_name(f"node{rank}.log")
    node = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    node.log = log
    return node


def finish(node, timeout=240) -> str:
    node.wait(timeout=timeout)
    return node.log.read_text()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_nodes_train_like_one(strategy, tmp_path, tiny_model_dir, runs):
    """The strategy matrix's recipe on 2 nodes x 1 process equals its one-node run on 2 processes."""
    one = strategy_run(runs, tiny_model_dir, strategy, False)
    two = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "two")
    port = free_port()
    nodes = [make_node(strategy, rank, port, two) for rank in (0, 1)]
    outputs = [finish(node) for node in nodes]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-4000:]
    assert "processes=2" in outputs[0]
    single = [r["loss"] for r in read_metrics(one.out) if "loss" in r]
    multi = [r["loss"] for r in read_metrics(tmp_path / "two") if "loss" in r]
    assert len(multi) == 10 and multi == pytest.approx(single, rel=1e-5)
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()


def test_two_nodes_hold_the_two_stages_of_a_pipeline(tmp_path, tiny_model_dir, runs):
    """`make train-fsdp-pp NODES=2 GPUS=1` (PP=2 by default): each node runs one stage, only activations and their
    gradients cross between them; the matrix's recipe (one data rank: 2 rows x accumulation 2) equals one process."""
    one = strategy_run(runs, tiny_model_dir, "single_gpu", False)
    two = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "two", processes=1)
    port = free_port()
    nodes = [make_node("fsdp-pp", rank, port, two) for rank in (0, 1)]
    outputs = [finish(node) for node in nodes]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-4000:]
    assert "mesh=pp=2 " in outputs[0] and "processes=2" in outputs[0]
    single = [r["loss"] for r in read_metrics(one.out) if "loss" in r]
    multi = [r["loss"] for r in read_metrics(tmp_path / "two") if "loss" in r]
    assert len(multi) == 10 and multi == pytest.approx(single, rel=1e-5)
    assert (tmp_path / "two" / "final" / "model.safetensors.index.json").is_file()


def test_wrong_master_address_fails_fast_with_the_address(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out"))
    port = free_port()  # nobody listens there: node 1 can never join
    started = time.time()
    node = make_node("ddp", 1, port, recipe, timeout_s=10)
    out = finish(node, timeout=120)
    assert node.returncode != 0
    assert time.time() - started < 90, "did not respect RDZV_TIMEOUT"
    assert f"timed out after 10000ms while trying to connect to (127.0.0.1, {port})" in out
    (tmp_path / "node1.log").write_text(out)
    found = diagnose([tmp_path / "node1.log"])
    assert found[0].id == "rendezvous_unreachable" and found[0].details["port"] == str(port)

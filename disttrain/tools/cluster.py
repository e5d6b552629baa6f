"""The one entry every cluster engine runs on each node: `python -m disttrain.tools.cluster --strategy S --recipe R`.

Each engine tells a node where it stands in its own variables; here they are read, in one place, into what a node's
launch needs (the nodes, this node's rank, the rendezvous address and port, its GPUs), and the node runs the same
`make train-<strategy>` the README shows for several nodes (building nothing: `-o tiny`), so every engine launches
exactly as SSH-by-hand does:

    engine      node rank             nodes               rendezvous address             GPUs per node
    kubernetes  JOB_COMPLETION_INDEX  DISTTRAIN_NODES     DISTTRAIN_MASTER_ADDR (pod 0)  DISTTRAIN_GPUS
    pytorchjob  RANK (the pod's)      WORLD_SIZE (pods)   MASTER_ADDR, MASTER_PORT       DISTTRAIN_GPUS
    skypilot    SKYPILOT_NODE_RANK    SKYPILOT_NUM_NODES  SKYPILOT_NODE_IPS' first line  SKYPILOT_NUM_GPUS_PER_NODE
    slurm       SLURM_NODEID          SLURM_NNODES        MASTER_ADDR, else the first    GPUS_PER_NODE, else
                                                          host of SLURM_JOB_NODELIST     SLURM_GPUS_ON_NODE
    disttrain   DISTTRAIN_NODE_RANK   DISTTRAIN_NODES     DISTTRAIN_MASTER_ADDR          DISTTRAIN_GPUS
                (the Ray launcher's, and anyone's own)

The engine is `--engine`, else the first whose marker variable is set (DISTTRAIN_ENGINE names it too); the port is
DISTTRAIN_MASTER_PORT (else MASTER_PORT, else 29500). Arguments after the recipe: NAME=value (upper case: make
variables, e.g. TP=2 EP=8 MAX_RESTARTS=3) or recipe overrides (key.path=value). A variable an engine should have
set and did not is one line naming it. `--dry-run` prints the command instead of running it.

A preemption reaches the whole run: SIGTERM / SIGINT to this entry (kubelet signals the container's main process)
are forwarded to the launch, and the entry exits only when every process under it has (disttrain/tools/supervise.py):
after the workers' checkpoint, with 143, which every engine reads as "run it again" (the next start resumes).

The manifests and task files that run this entry: `make k8s` (disttrain/tools/k8s.py), `make sky`
(disttrain/tools/sky.py), `make ray` (disttrain/tools/ray_launch.py), SLURM's scripts/slurm/train.sbatch.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.tools import supervise

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 29500
DEFAULT_SHUTDOWN_TIMEOUT = 600  # the Makefile's SHUTDOWN_TIMEOUT: how long the launcher lets workers checkpoint
# what an engine sets to describe the pod or task, not a worker: torchrun sets its own per worker, and PET_* would
# become torchrun's defaults (the launch passes every one it needs explicitly)
NODE_ONLY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True)
class Node:
    """Where this node stands, in the terms `make train-* NODES=... NODE_RANK=...` takes."""
    nodes: int
    rank: int
    master_addr: str
    master_port: int
    gpus: int

    def make_variables(self) -> dict[str, str]:
        return {"NODES": str(self.nodes), "NODE_RANK": str(self.rank), "GPUS": str(self.gpus),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def _need(env: dict, engine: str, name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise DisttrainError(f"{engine}: the variable {name} is not set on this node; run this entry under {engine} "
                             "(or name another with --engine)")
    return value


def _integer(env: dict, engine: str, name: str) -> int:
    value = _need(env, engine, name)
    if not value.isdigit():
        raise DisttrainError(f"{engine}: {name}={value!r} is not a whole number")
    return int(value)


def _port(env: dict) -> int:
    return int(env.get("DISTTRAIN_MASTER_PORT") or env.get("MASTER_PORT") or DEFAULT_PORT)


def _kubernetes(env: dict) -> Node:
    """An indexed Job: the pod's completion index; the rest from the variables `make k8s` writes into the Job."""
    e = "kubernetes"
    return Node(_integer(env, e, "DISTTRAIN_NODES"), _integer(env, e, "JOB_COMPLETION_INDEX"),
                _need(env, e, "DISTTRAIN_MASTER_ADDR"), _port(env), _integer(env, e, "DISTTRAIN_GPUS"))


def _pytorchjob(env: dict) -> Node:
    """Kubeflow's PyTorchJob: the operator sets the pod's RANK (Master 0, Worker i: i + 1), WORLD_SIZE (pods) and
    the Master's service as MASTER_ADDR / MASTER_PORT."""
    e = "pytorchjob"
    return Node(_integer(env, e, "WORLD_SIZE"), _integer(env, e, "RANK"), _need(env, e, "MASTER_ADDR"),
                int(_need(env, e, "MASTER_PORT")), _integer(env, e, "DISTTRAIN_GPUS"))


def _skypilot(env: dict) -> Node:
    e = "skypilot"
    head = _need(env, e, "SKYPILOT_NODE_IPS").split()[0]
    return Node(_integer(env, e, "SKYPILOT_NUM_NODES"), _integer(env, e, "SKYPILOT_NODE_RANK"), head, _port(env),
                _integer(env, e, "SKYPILOT_NUM_GPUS_PER_NODE"))


def _slurm(env: dict) -> Node:
    e = "slurm"
    addr = env.get("MASTER_ADDR") or _first_host(_need(env, e, "SLURM_JOB_NODELIST"))
    gpus = env.get("GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE")  # the sbatch script's knob first
    if not gpus:
        raise DisttrainError("slurm: neither SLURM_GPUS_ON_NODE nor GPUS_PER_NODE is set: ask for GPUs "
                             "(#SBATCH --gpus-per-node=N) or set GPUS_PER_NODE")
    return Node(_integer(env, e, "SLURM_NNODES"), _integer(env, e, "SLURM_NODEID"), addr, _port(env), int(gpus))


def _first_host(nodelist: str) -> str:
    """The job's first host: scontrol expands SLURM's compressed list (node[0-3]); a plain name stands as it is."""
    if not re.search(r"[\[,]", nodelist):
        return nodelist
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.split():
        raise DisttrainError(f"slurm: scontrol could not expand SLURM_JOB_NODELIST={nodelist}; set MASTER_ADDR")
    return out.stdout.split()[0]


def _disttrain(env: dict) -> Node:
    e = "disttrain"
    return Node(_integer(env, e, "DISTTRAIN_NODES"), _integer(env, e, "DISTTRAIN_NODE_RANK"),
                _need(env, e, "DISTTRAIN_MASTER_ADDR"), _port(env), _integer(env, e, "DISTTRAIN_GPUS"))


# engine -> (how it reads a node, the variable that says a node runs under it), in the order detection tries them
ENGINES = {"kubernetes": (_kubernetes, "JOB_COMPLETION_INDEX"), "pytorchjob": (_pytorchjob, "PET_NPROC_PER_NODE"),
           "skypilot": (_skypilot, "SKYPILOT_NODE_RANK"), "slurm": (_slurm, "SLURM_NODEID"),
           "disttrain": (_disttrain, "DISTTRAIN_NODE_RANK")}


def engine_of(env: dict, named: str | None = None) -> str:
    name = named or env.get("DISTTRAIN_ENGINE") or next((e for e, (_, mark) in ENGINES.items() if env.get(mark)), None)
    if name is None:
        raise DisttrainError("no cluster engine's variables are set on this node (JOB_COMPLETION_INDEX, "
                             "SKYPILOT_NODE_RANK, SLURM_NODEID, DISTTRAIN_NODE_RANK, ...); name one with --engine")
    if name not in ENGINES:
        raise DisttrainError(f"--engine {name}: not one of {', '.join(ENGINES)}")
    return name


def node_of(env: dict, named: str | None = None) -> tuple[str, Node]:
    engine = engine_of(env, named)
    node = ENGINES[engine][0](env)
    if not 0 <= node.rank < node.nodes:
        raise DisttrainError(f"{engine}: node rank {node.rank} is not below the {node.nodes} nodes")
    return engine, node


def command(node: Node, strategy: str, recipe: str, extra: list[str]) -> list[str]:
    """`make -s train-<strategy>` with the node's variables; NAME=value arguments as make variables, the others as
    the recipe's overrides (ARGS)."""
    make_vars = [a for a in extra if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", a)]
    overrides = [a for a in extra if a not in make_vars]
    if not (REPO / "accelerate_configs" / f"{strategy}.yaml").is_file() or strategy == "single_gpu":
        choices = sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml") if p.stem != "single_gpu")
        raise DisttrainError(f"--strategy {strategy}: no accelerate_configs/{strategy}.yaml for several nodes; one of "
                             + ", ".join(choices))
    target = "train-" + strategy.replace("_", "-")
    # -o tiny: a node builds nothing (the tiny model, the install): its image or the shared filesystem has them
    return ["make", "-s", "-o", "tiny", target, *(f"{k}={v}" for k, v in node.make_variables().items()), *make_vars,
            f"RECIPE={recipe}", *([f"ARGS={' '.join(overrides)}"] if overrides else [])]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, help="an accelerate config's name: ddp, fsdp, zero3, fsdp_ep, ...")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--engine", choices=list(ENGINES), help="default: the one whose variables are set")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args, extra = parser.parse_known_args(argv)
    engine, node = node_of(dict(os.environ), args.engine)
    cmd = command(node, args.strategy, args.recipe, extra)
    print(f"cluster: {engine} node {node.rank} of {node.nodes}, {node.gpus} GPUs, rendezvous "
          f"{node.master_addr}:{node.master_port}", flush=True)
    if args.dry_run:
        print(" ".join(cmd))
        return
    env = {k: v for k, v in os.environ.items() if k not in NODE_ONLY and not k.startswith("PET_")}
    code = supervise.run(cmd, REPO, env, shutdown_timeout(extra))
    if code > 128:
        print(f"cluster: stopped by signal {code - 128}; every process of the run has exited. The same command "
              "resumes from the newest complete checkpoint.", flush=True)
    sys.exit(code)


def shutdown_timeout(extra: list[str]) -> int:
    """SHUTDOWN_TIMEOUT as the node's make gets it: how long the workers may checkpoint after a SIGTERM."""
    given = [a.split("=", 1)[1] for a in extra if a.startswith("SHUTDOWN_TIMEOUT=")]
    if given and not given[-1].isdigit():
        raise DisttrainError(f"SHUTDOWN_TIMEOUT={given[-1]!r} is not a whole number of seconds")
    return int(given[-1]) if given else DEFAULT_SHUTDOWN_TIMEOUT


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

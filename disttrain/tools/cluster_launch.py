"""What a cluster launch is, checked once for every file that describes one (`make k8s`, `make sky`): the recipe
(validated with its overrides), the strategy, the nodes and GPUs per node, the mesh variables that must fit them,
the run's name, output.dir on the shared volume, and the cluster entry's command line every node runs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from disttrain.errors import DisttrainError
from disttrain.tools.cluster import shutdown_timeout

REPO = Path(__file__).resolve().parents[2]
MOUNT = "/outputs"  # where the shared volume (a claim, a bucket) is mounted on every node
RDZV_MARGIN_S = 300  # a restarted node waits at the rendezvous this much longer than a collective's timeout


@dataclass(frozen=True)
class ClusterLaunch:
    recipe_path: str
    strategy: str
    nodes: int
    gpus: int  # per node
    make_vars: tuple[str, ...]  # NAME=value: the node's make variables (TP=2, EP=8, ...)
    overrides: tuple[str, ...]  # key.path=value: the recipe's
    name: str  # the run's name on the cluster
    output_dir: str  # the recipe's output.dir on the shared volume
    shutdown_s: int  # SHUTDOWN_TIMEOUT: after a SIGTERM, how long the workers may checkpoint

    def entry(self, python: str, engine: str, shared: bool) -> list[str]:
        """The command every node runs (disttrain/tools/cluster.py); `shared`: output.dir on the volume."""
        return [python, "-m", "disttrain.tools.cluster", "--engine", engine, "--strategy", self.strategy,
                "--recipe", self.recipe_path, *self.make_vars, *self.overrides,
                *([f"output.dir={self.output_dir}"] if shared else [])]


def launch_parser(doc: str, nodes: int = 1, files: bool = True):
    """The arguments every cluster launcher takes (NAME=value and key.path=value come after them); `files`: it
    renders a file (a name, restarts, the rendezvous port, where to write it)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--strategy", required=True, help="an accelerate config's name: ddp, fsdp, fsdp_ep, ...")
    parser.add_argument("--nodes", type=int, default=nodes)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs (processes) per node")
    if files:
        parser.add_argument("--name", default="", help="default: the recipe's output directory's name")
        parser.add_argument("--max-restarts", type=int, default=3)
        parser.add_argument("--port", type=int, default=29500)
        parser.add_argument("--out", default="", help="a file (default: stdout)")
    return parser


def checked_launch(recipe_path: str, strategy: str, nodes: int, gpus: int, extra: list[str],
                   name: str = "") -> ClusterLaunch:
    """Every input checked, one line for the first that is wrong: nodes and GPUs, the strategy's config, the mesh
    variables against GPUS x NODES, the recipe with its overrides, the name."""
    from disttrain.recipe.schema import load_recipe

    if nodes < 1 or gpus < 1:
        raise DisttrainError(f"NODES={nodes} GPUS={gpus}: both must be at least 1 (GPUS: per node)")
    if not (REPO / "accelerate_configs" / f"{strategy}.yaml").is_file() or (strategy == "single_gpu" and nodes > 1):
        raise DisttrainError(f"STRATEGY={strategy}: no accelerate_configs/{strategy}.yaml for {nodes} nodes")
    make_vars = [a for a in extra if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", a)]
    problem = mesh_problem(strategy, nodes, gpus, dict(a.split("=", 1) for a in make_vars))
    if problem:
        raise DisttrainError(problem)
    overrides = [a for a in extra if a not in make_vars]
    recipe = load_recipe(recipe_path, overrides)
    shutdown_s = shutdown_timeout(make_vars)
    given = {a.split("=", 1)[0] for a in make_vars}
    make_vars += [f"{k}={v}" for k, v in (("SHUTDOWN_TIMEOUT", shutdown_s),
                                         ("RDZV_TIMEOUT", recipe.distributed.timeout_s + RDZV_MARGIN_S))
                  if k not in given]
    name = name or re.sub(r"[^a-z0-9-]+", "-", Path(recipe.output.dir.split("{")[0]).name.lower()).strip("-")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?", name):
        raise DisttrainError(f"NAME={name!r}: a run's name on a cluster is lower-case letters, digits and '-', at "
                             "most 52")
    return ClusterLaunch(recipe_path, strategy, nodes, gpus, tuple(make_vars), tuple(overrides), name,
                         shared_output_dir(recipe.output.dir), shutdown_s)


def mesh_problem(strategy: str, nodes: int, gpus: int, make_vars: dict[str, str]) -> str | None:
    """What in TP / SP / CP / EP / HSDP_REPLICAS does not fit GPUS x NODES, as the Makefile would split them."""
    total = nodes * gpus
    replicas = int(make_vars.get("HSDP_REPLICAS", nodes))
    sizes = {"TP": int(make_vars.get("TP", 2)), "SP": int(make_vars.get("SP", 2)), "CP": int(make_vars.get("CP", 2)),
             "EP": int(make_vars.get("EP", gpus)), "PP": int(make_vars.get("PP", 2))}
    needs = {"hsdp": [("HSDP_REPLICAS", replicas, total)], "zero3_ulysses": [("SP", sizes["SP"], total)],
             "fsdp_cp": [("CP", sizes["CP"], total)],
             "fsdp_tp": [("HSDP_REPLICAS", replicas, total), ("TP", sizes["TP"], gpus)],
             "fsdp_ep": [("HSDP_REPLICAS", replicas, total), ("EP", sizes["EP"], total // max(replicas, 1))],
             "fsdp_pp": [("PP", sizes["PP"], total)]}
    what = {"TP": f"GPUS={gpus} (a tensor-parallel group stays in one node)",
            "EP": f"the GPUs of a replica, GPUS x NODES / HSDP_REPLICAS = {total // max(replicas, 1)}"}
    for name, size, of in needs.get(strategy, []):
        if size < 1 or of % size:
            return f"{name}={size} does not divide {what.get(name, f'GPUS x NODES = {total}')}: change {name} or GPUS"
    if strategy == "tp" and nodes > 1:
        return "tp.yaml splits every weight over the GPUs of one node: NODES=1, or fsdp_tp with TP=GPUS"
    return None


def shared_output_dir(output_dir: str) -> str:
    """A recipe's output.dir on the shared volume: its relative path below the mount, outputs/ dropped."""
    out = PurePosixPath(output_dir)
    if out.is_absolute():
        if not str(out).startswith(MOUNT + "/"):
            raise DisttrainError(f"output.dir={out} is outside the shared volume mounted at {MOUNT}: use a relative "
                                 f"output.dir, or one below {MOUNT}/")
        return str(out)
    parts = out.parts[1:] if out.parts and out.parts[0] == "outputs" else out.parts
    return str(PurePosixPath(MOUNT, *parts))


def emit(text: str, out: str, written: str) -> None:
    """The rendered file to `out` (saying `written`), or to stdout."""
    if out:
        Path(out).write_text(text)
        print(written)
    else:
        print(text, end="")

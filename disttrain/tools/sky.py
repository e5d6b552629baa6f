"""`make sky`: a SkyPilot task file for a recipe on NODES nodes of GPUS accelerators each, to a file or stdout.

    make sky NODES=2 GPUS=8 ACCELERATOR=H100 BUCKET=my-train-outputs RECIPE=recipes/llama-3.1-8b/full_sft_fsdp.yaml \
        STRATEGY=fsdp OUT=task.yaml && sky jobs launch task.yaml            # managed: recovers from preemption

The task: `resources` (ACCELERATOR:GPUS, `use_spot` with SPOT=1, and for managed jobs `job_recovery`: a preempted
or failed job is started again, MAX_RESTARTS times on errors, and resumes from its newest complete checkpoint),
`num_nodes`, `workdir: .` (this repository, synced to every node), the bucket BUCKET mounted at /outputs with
output.dir below it (NODES > 1 or spot instances need it: checkpoints must outlive a node), `setup` = the README's
install (`make setup`), and `run` = the one entry every node runs (disttrain/tools/cluster.py), which reads
SkyPilot's node rank, node IPs and GPUs per node. Tokens: `sky jobs launch --secret HF_TOKEN --secret
WANDB_API_KEY task.yaml` passes them from your shell, never written in the file. Bad inputs stop at render time
in one line, nothing written (as `make k8s`: no BUCKET for several or spot nodes, a mesh that does not fit, an
unknown strategy or accelerator name, a recipe that does not validate). tests/test_clusters.py checks the file
against SkyPilot's documented task fields.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.tools.k8s import MOUNT, mesh_problem, output_dir

REPO = Path(__file__).resolve().parents[2]


def render(args, extra: list[str]) -> dict:
    from disttrain.recipe.schema import load_recipe

    if args.nodes < 1 or args.gpus < 1:
        raise DisttrainError(f"NODES={args.nodes} GPUS={args.gpus}: both must be at least 1 (GPUS: per node)")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.accelerator or ""):
        raise DisttrainError(f"ACCELERATOR={args.accelerator!r}: an accelerator name as SkyPilot lists them "
                             "(`sky show-gpus`), e.g. H100, A100-80GB, L4")
    if (args.nodes > 1 or args.spot) and not args.bucket:
        raise DisttrainError(f"NODES={args.nodes}{' SPOT=1' if args.spot else ''}: checkpoints must outlive a node "
                             "(every rank writes them; a preempted node takes its disk along); give BUCKET=<a bucket "
                             "name> to mount at /outputs")
    if not (REPO / "accelerate_configs" / f"{args.strategy}.yaml").is_file():
        raise DisttrainError(f"STRATEGY={args.strategy}: no accelerate_configs/{args.strategy}.yaml")
    make_vars = dict(a.split("=", 1) for a in extra if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", a))
    problem = mesh_problem(args.strategy, args.nodes, args.gpus, make_vars)
    if problem:
        raise DisttrainError(problem)
    recipe = load_recipe(args.recipe, [a for a in extra if a.split("=", 1)[0] not in make_vars])
    entry = [".venv/bin/python", "-m", "disttrain.tools.cluster", "--engine", "skypilot", "--strategy", args.strategy,
             "--recipe", args.recipe, *extra]
    if args.bucket:
        entry.append(f"output.dir={output_dir(recipe)}")
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", Path(recipe.output.dir.split("{")[0]).name.lower()).strip("-")
    resources = {"accelerators": f"{args.accelerator}:{args.gpus}", "use_spot": bool(args.spot),
                 "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": args.max_restarts}}
    task = {"name": name, "resources": resources, "num_nodes": args.nodes, "workdir": ".",
            "envs": {"DISTTRAIN_MASTER_PORT": str(args.port)}}
    if args.bucket:
        task["file_mounts"] = {MOUNT: {"name": args.bucket, "mode": "MOUNT"}}
    task["setup"] = "make setup GPU=1\n"
    task["run"] = " ".join(_quoted(a) for a in entry) + "\n"
    return task


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, as SkyPilot's examples write them."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def _quoted(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:,+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=8, help="accelerators per node")
    parser.add_argument("--accelerator", default="H100")
    parser.add_argument("--bucket", default="", help="a bucket every node mounts at /outputs")
    parser.add_argument("--spot", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--name", default="")
    parser.add_argument("--out", default="")
    args, extra = parser.parse_known_args(argv)
    text = yaml.dump(render(args, extra), Dumper=_Dumper, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"sky: wrote {args.out} ({args.nodes} x {args.accelerator}:{args.gpus}); sky jobs launch {args.out}")
    else:
        print(text, end="")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

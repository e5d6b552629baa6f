"""`make sky`: a SkyPilot task file for a recipe on NODES nodes of GPUS accelerators each, to a file or stdout.

    make sky NODES=2 GPUS=8 ACCELERATOR=H100 BUCKET=my-train-outputs RECIPE=recipes/llama-3.1-8b/full_sft_fsdp.yaml \
        STRATEGY=fsdp OUT=task.yaml && sky jobs launch task.yaml            # managed: recovers from preemption

The task: `resources` (ACCELERATOR:GPUS, `use_spot` with SPOT=1, and for managed jobs `job_recovery`: a preempted
or failed job is started again, MAX_RESTARTS times on errors, and resumes from its newest complete checkpoint),
`num_nodes`, `workdir: .` (this repository, synced to every node), the bucket BUCKET mounted at /outputs
(MOUNT_CACHED: SkyPilot's mode for checkpoints; plain MOUNT refuses appends and renames) with output.dir below
it (NODES > 1 or spot instances need it: checkpoints must outlive a node), `setup` = the README's install (`make
setup`), and `run` = the one entry every node runs (disttrain/tools/cluster.py), which reads
SkyPilot's node rank, node IPs and GPUs per node. Tokens: `sky jobs launch --secret HF_TOKEN --secret
WANDB_API_KEY task.yaml` passes them from your shell, never written in the file. Bad inputs stop at render time
in one line, nothing written (as `make k8s`: no BUCKET for several or spot nodes, a mesh that does not fit, an
unknown strategy or accelerator name, a recipe that does not validate). tests/test_clusters.py checks the file
against SkyPilot's documented task fields.
"""

from __future__ import annotations

import re
import sys

import yaml

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.tools.cluster_launch import MOUNT, checked_launch, emit, launch_parser


def render(args, extra: list[str]) -> dict:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.accelerator or ""):
        raise DisttrainError(f"ACCELERATOR={args.accelerator!r}: an accelerator name as SkyPilot lists them "
                             "(`sky show-gpus`), e.g. H100, A100-80GB, L4")
    if (args.nodes > 1 or args.spot) and not args.bucket:
        raise DisttrainError(f"NODES={args.nodes}{' SPOT=1' if args.spot else ''}: checkpoints must outlive a node "
                             "(every rank writes them; a preempted node takes its disk along); give BUCKET=<a bucket "
                             "name> to mount at /outputs")
    launch = checked_launch(args.recipe, args.strategy, args.nodes, args.gpus, extra, args.name)
    resources = {"accelerators": f"{args.accelerator}:{args.gpus}", "use_spot": bool(args.spot),
                 "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": args.max_restarts}}
    task = {"name": launch.name, "resources": resources, "num_nodes": args.nodes, "workdir": ".",
            "envs": {"DISTTRAIN_MASTER_PORT": str(args.port)}}
    if args.bucket:
        # MOUNT_CACHED: writes go to a local cache and are uploaded behind them. Plain MOUNT supports no appends or
        # random writes (SkyPilot's storage docs), and a run appends to metrics.jsonl and renames checkpoint dirs
        task["file_mounts"] = {MOUNT: {"name": args.bucket, "mode": "MOUNT_CACHED"}}
    task["setup"] = "make setup GPU=1\n"
    entry = launch.entry(".venv/bin/python", "skypilot", shared=bool(args.bucket))
    task["run"] = " ".join(_quoted(a) for a in entry) + "\n"
    return task


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, as SkyPilot's examples write them."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def _quoted(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:,+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def main(argv=None) -> None:
    parser = launch_parser(__doc__)
    parser.add_argument("--accelerator", default="H100")
    parser.add_argument("--bucket", default="", help="a bucket every node mounts at /outputs")
    parser.add_argument("--spot", type=int, default=0)
    args, extra = parser.parse_known_args(argv)
    emit(yaml.dump(render(args, extra), Dumper=_Dumper, sort_keys=False), args.out,
         f"sky: wrote {args.out} ({args.nodes} x {args.accelerator}:{args.gpus}); sky jobs launch {args.out}")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

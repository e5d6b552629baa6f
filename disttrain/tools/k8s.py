"""`make k8s`: Kubernetes manifests for a recipe on NODES pods of GPUS GPUs each, to a file or stdout.

    make k8s NODES=2 GPUS=8 RECIPE=recipes/llama-3.1-8b/full_sft_fsdp.yaml STRATEGY=fsdp IMAGE=reg/disttrain:1 \
        PVC=train-outputs OUT=job.yaml && kubectl apply -f job.yaml

Two kinds (K8S_KIND): `job` (default) is an indexed Job and a headless Service: pod i has the completion index i
(its node rank) and the DNS name <name>-i.<name>, so every pod meets pod 0 there (torchrun's static rendezvous);
`pytorchjob` is Kubeflow's PyTorchJob (kubeflow.org/v1: a Master and NODES - 1 Workers; the training operator
sets the rendezvous). Either way every pod runs the one entry (disttrain/tools/cluster.py) that runs
`make train-<strategy>` for its node. What the manifests hold:
- output.dir on the claim PVC (mounted at /outputs; NODES > 1 needs one every pod mounts: checkpoints are written
  by every rank); the recipe's own output.dir below it;
- the GPUs as `nvidia.com/gpu` requests and limits, /dev/shm as a memory volume (SHM, default 64Gi: NCCL and the
  data loaders use it; a pod's default 64 MB stalls them);
- restarts: restartPolicy OnFailure and backoffLimit MAX_RESTARTS (default 3): a lost rank fails the others at
  their next collective, the pods start again and the same command resumes from the newest complete checkpoint
  (output.resume: auto);
- the Hub and W&B tokens from the Secret SECRET (default disttrain-secrets, keys HF_TOKEN and WANDB_API_KEY,
  optional) by reference, never inline.
Bad inputs stop at render time in one line, nothing written: no IMAGE, NODES > 1 without PVC, a mesh that does not
fit GPUS x NODES (TP, SP, CP, EP, HSDP_REPLICAS), an unknown strategy, a recipe that does not validate.
Validated in the suite: the Job and Service by kubernetes-validate (the API's own schemas); the PyTorchJob's fields
against the names its published CRD defines (tests/test_clusters.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path, PurePosixPath

import yaml

from disttrain.errors import DisttrainError, exit_on_user_error

REPO = Path(__file__).resolve().parents[2]
MOUNT = "/outputs"
WORKDIR = "/workspace/disttrain"  # where the image holds this repository (and its .venv)


def mesh_problem(strategy: str, nodes: int, gpus: int, make_vars: dict[str, str]) -> str | None:
    """What in TP / SP / CP / EP / HSDP_REPLICAS does not fit GPUS x NODES, as the Makefile would split them."""
    total = nodes * gpus
    replicas = int(make_vars.get("HSDP_REPLICAS", nodes))
    sizes = {"TP": int(make_vars.get("TP", 2)), "SP": int(make_vars.get("SP", 2)), "CP": int(make_vars.get("CP", 2)),
             "EP": int(make_vars.get("EP", gpus))}
    needs = {"hsdp": [("HSDP_REPLICAS", replicas, total)], "zero3_ulysses": [("SP", sizes["SP"], total)],
             "fsdp_cp": [("CP", sizes["CP"], total)],
             "fsdp_tp": [("HSDP_REPLICAS", replicas, total), ("TP", sizes["TP"], gpus)],
             "fsdp_ep": [("HSDP_REPLICAS", replicas, total), ("EP", sizes["EP"], total // max(replicas, 1))]}
    what = {"TP": f"GPUS={gpus} (a tensor-parallel group stays in one pod)",
            "EP": f"the GPUs of a replica, GPUS x NODES / HSDP_REPLICAS = {total // max(replicas, 1)}"}
    for name, size, of in needs.get(strategy, []):
        if size < 1 or of % size:
            return f"{name}={size} does not divide {what.get(name, f'GPUS x NODES = {total}')}: change {name} or GPUS"
    if strategy == "tp" and nodes > 1:
        return "tp.yaml splits every weight over the GPUs of one node: NODES=1, or fsdp_tp with TP=GPUS"
    return None


def output_dir(recipe) -> str:
    """The recipe's output.dir on the shared volume: its relative path below the mount, outputs/ dropped."""
    out = PurePosixPath(recipe.output.dir)
    if out.is_absolute():
        if not str(out).startswith(MOUNT + "/"):
            raise DisttrainError(f"output.dir={out} is outside the shared volume mounted at {MOUNT}: use a relative "
                                 f"output.dir, or one below {MOUNT}/")
        return str(out)
    parts = out.parts[1:] if out.parts and out.parts[0] == "outputs" else out.parts
    return str(PurePosixPath(MOUNT, *parts))


def checked_inputs(args, extra: list[str]):
    """The recipe loaded and every input checked, one line for the first that is wrong."""
    from disttrain.recipe.schema import load_recipe

    if not args.image:
        raise DisttrainError("IMAGE is not set: the container image holding this repository and its .venv at "
                             f"{WORKDIR} (docs/clusters.md says how to build one), e.g. IMAGE=registry/disttrain:1")
    if args.nodes < 1 or args.gpus < 1:
        raise DisttrainError(f"NODES={args.nodes} GPUS={args.gpus}: both must be at least 1 (GPUS: per pod)")
    if args.nodes > 1 and not args.pvc:
        raise DisttrainError(f"NODES={args.nodes}: every pod writes checkpoints into output.dir, which must be on "
                             "storage they all mount; give PVC=<a ReadWriteMany PersistentVolumeClaim>")
    config = REPO / "accelerate_configs" / f"{args.strategy}.yaml"
    if not config.is_file() or (args.strategy == "single_gpu" and args.nodes > 1):
        raise DisttrainError(f"STRATEGY={args.strategy}: no accelerate_configs/{args.strategy}.yaml for "
                             f"{args.nodes} pods")
    make_vars = dict(a.split("=", 1) for a in extra if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", a))
    problem = mesh_problem(args.strategy, args.nodes, args.gpus, make_vars)
    if problem:
        raise DisttrainError(problem)
    overrides = [a for a in extra if a.split("=", 1)[0] not in make_vars]
    recipe = load_recipe(args.recipe, overrides)
    return recipe, [*extra, f"output.dir={output_dir(recipe)}"]


def _container(args, name: str, engine: str, entry_args: list[str], container: str, port_name: str) -> dict:
    env = [{"name": "DISTTRAIN_ENGINE", "value": engine}, {"name": "DISTTRAIN_NODES", "value": str(args.nodes)},
           {"name": "DISTTRAIN_GPUS", "value": str(args.gpus)}]
    if engine == "kubernetes":
        env += [{"name": "DISTTRAIN_MASTER_ADDR", "value": f"{name}-0.{name}"},
                {"name": "DISTTRAIN_MASTER_PORT", "value": str(args.port)}]
    env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": args.secret, "key": key, "optional": True}}}
            for key in ("HF_TOKEN", "WANDB_API_KEY")]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "outputs", "mountPath": MOUNT}]
    gpus = {"nvidia.com/gpu": args.gpus}
    return {"name": container, "image": args.image, "imagePullPolicy": "IfNotPresent", "workingDir": WORKDIR,
            "command": [".venv/bin/python", "-m", "disttrain.tools.cluster", "--engine", engine,
                        "--strategy", args.strategy, "--recipe", args.recipe, *entry_args],
            "env": env, "ports": [{"name": port_name, "containerPort": args.port}],
            "resources": {"requests": dict(gpus), "limits": dict(gpus)}, "volumeMounts": mounts}


def _volumes(args) -> list[dict]:
    outputs = ({"persistentVolumeClaim": {"claimName": args.pvc}} if args.pvc else {"emptyDir": {}})
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": args.shm}}, {"name": "outputs", **outputs}]


def indexed_job(args, name: str, entry_args: list[str]) -> list[dict]:
    def labels():  # a dict each time: the YAML then carries no anchors
        return {"app.kubernetes.io/name": "disttrain", "disttrain/run": name}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels()},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": args.port, "targetPort": args.port}]}}
    pod = {"metadata": {"labels": labels()},
           "spec": {"subdomain": name, "restartPolicy": "OnFailure",
                    "containers": [_container(args, name, "kubernetes", entry_args, "train", "rendezvous")],
                    "volumes": _volumes(args)}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels()},
           "spec": {"completionMode": "Indexed", "completions": args.nodes, "parallelism": args.nodes,
                    "backoffLimit": args.max_restarts, "template": pod}}
    return [service, job]


def pytorchjob(args, name: str, entry_args: list[str]) -> list[dict]:
    """The training operator's names: the container `pytorch`, its port `pytorchjob-port` (the operator reads the
    Master's from it and sets MASTER_ADDR / MASTER_PORT, WORLD_SIZE and each pod's RANK)."""
    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [_container(args, name, "pytorchjob", entry_args, "pytorch",
                                                                 "pytorchjob-port")],
                                      "volumes": _volumes(args)}}}
    specs = {"Master": replica(1), **({"Worker": replica(args.nodes - 1)} if args.nodes > 1 else {})}
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
             "spec": {"runPolicy": {"backoffLimit": args.max_restarts, "cleanPodPolicy": "None"},
                      "pytorchReplicaSpecs": specs}}]


def render(args, extra: list[str]) -> list[dict]:
    recipe, entry_args = checked_inputs(args, extra)
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", Path(recipe.output.dir.split("{")[0]).name.lower()).strip("-")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?", name or ""):
        raise DisttrainError(f"NAME={name!r}: a Kubernetes name is lower-case letters, digits and '-', at most 52")
    return (indexed_job if args.kind == "job" else pytorchjob)(args, name, entry_args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per pod")
    parser.add_argument("--image", default="")
    parser.add_argument("--pvc", default="", help="a PersistentVolumeClaim every pod mounts at /outputs")
    parser.add_argument("--kind", choices=["job", "pytorchjob"], default="job")
    parser.add_argument("--name", default="", help="default: the recipe's output directory's name")
    parser.add_argument("--shm", default="64Gi")
    parser.add_argument("--secret", default="disttrain-secrets")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--out", default="", help="a file (default: stdout)")
    args, extra = parser.parse_known_args(argv)
    text = yaml.safe_dump_all(render(args, extra), sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"k8s: wrote {args.out} ({args.kind}, {args.nodes} x {args.gpus} GPUs); kubectl apply -f {args.out}")
    else:
        print(text, end="")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

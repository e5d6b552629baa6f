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

import sys

import yaml

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.tools.cluster_launch import MOUNT, ClusterLaunch, checked_launch, emit, launch_parser

WORKDIR = "/workspace/disttrain"  # where the image holds this repository (and its .venv)


def checked_inputs(args, extra: list[str]) -> ClusterLaunch:
    """What only Kubernetes needs (an image, a claim for several pods), then what every cluster launch needs."""
    if not args.image:
        raise DisttrainError("IMAGE is not set: the container image holding this repository and its .venv at "
                             f"{WORKDIR} (docs/clusters.md says how to build one), e.g. IMAGE=registry/disttrain:1")
    if args.nodes > 1 and not args.pvc:
        raise DisttrainError(f"NODES={args.nodes}: every pod writes checkpoints into output.dir, which must be on "
                             "storage they all mount; give PVC=<a ReadWriteMany PersistentVolumeClaim>")
    return checked_launch(args.recipe, args.strategy, args.nodes, args.gpus, extra, args.name)


def _container(args, launch: ClusterLaunch, engine: str, container: str, port_name: str) -> dict:
    name = launch.name
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
            "command": launch.entry(".venv/bin/python", engine, shared=True),
            "env": env, "ports": [{"name": port_name, "containerPort": args.port}],
            "resources": {"requests": dict(gpus), "limits": dict(gpus)}, "volumeMounts": mounts}


def _volumes(args) -> list[dict]:
    outputs = ({"persistentVolumeClaim": {"claimName": args.pvc}} if args.pvc else {"emptyDir": {}})
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": args.shm}}, {"name": "outputs", **outputs}]


def indexed_job(args, launch: ClusterLaunch) -> list[dict]:
    name = launch.name

    def labels():  # a dict each time: the YAML then carries no anchors
        return {"app.kubernetes.io/name": "disttrain", "disttrain/run": name}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels()},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": args.port, "targetPort": args.port}]}}
    pod = {"metadata": {"labels": labels()},
           "spec": {"subdomain": name, "restartPolicy": "OnFailure",
                    "containers": [_container(args, launch, "kubernetes", "train", "rendezvous")],
                    "volumes": _volumes(args)}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels()},
           "spec": {"completionMode": "Indexed", "completions": args.nodes, "parallelism": args.nodes,
                    "backoffLimit": args.max_restarts, "template": pod}}
    return [service, job]


def pytorchjob(args, launch: ClusterLaunch) -> list[dict]:
    """The training operator's names: the container `pytorch`, its port `pytorchjob-port` (the operator reads the
    Master's from it and sets MASTER_ADDR / MASTER_PORT, WORLD_SIZE and each pod's RANK)."""
    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [_container(args, launch, "pytorchjob", "pytorch",
                                                                 "pytorchjob-port")],
                                      "volumes": _volumes(args)}}}
    specs = {"Master": replica(1), **({"Worker": replica(args.nodes - 1)} if args.nodes > 1 else {})}
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": launch.name},
             "spec": {"runPolicy": {"backoffLimit": args.max_restarts, "cleanPodPolicy": "None"},
                      "pytorchReplicaSpecs": specs}}]


def render(args, extra: list[str]) -> list[dict]:
    launch = checked_inputs(args, extra)
    return (indexed_job if args.kind == "job" else pytorchjob)(args, launch)


def main(argv=None) -> None:
    parser = launch_parser(__doc__)
    parser.add_argument("--image", default="")
    parser.add_argument("--pvc", default="", help="a PersistentVolumeClaim every pod mounts at /outputs")
    parser.add_argument("--kind", choices=["job", "pytorchjob"], default="job")
    parser.add_argument("--shm", default="64Gi")
    parser.add_argument("--secret", default="disttrain-secrets")
    args, extra = parser.parse_known_args(argv)
    emit(yaml.safe_dump_all(render(args, extra), sort_keys=False), args.out,
         f"k8s: wrote {args.out} ({args.kind}, {args.nodes} x {args.gpus} GPUs); kubectl apply -f {args.out}")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

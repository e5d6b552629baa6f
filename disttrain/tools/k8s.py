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
- preemption: a SIGTERM to a pod reaches its workers (the entry forwards it), which checkpoint within
  SHUTDOWN_TIMEOUT; the pod's terminationGracePeriodSeconds is that plus GRACE_MARGIN_S, so kubelet's SIGKILL comes
  after the launcher's own;
- restarts (the Job): restartPolicy Never, backoffLimitPerIndex MAX_RESTARTS (default 3) and maxFailedIndexes 0:
  a lost rank fails every pod once (the others at their next collective), so retries are counted per node rank, not
  summed over the pods (backoffLimit would be spent by one failure of a 4-pod job); a pod preempted, evicted or
  drained (the DisruptionTarget condition) is not counted at all (podFailurePolicy), and a pod is replaced only
  once the old one has exited (podReplacementPolicy Failed: it may still be writing its checkpoint). The
  PyTorchJob's operator counts restarts over all pods: its backoffLimit is MAX_RESTARTS x NODES. Either way the
  same command resumes from the newest complete checkpoint (output.resume: auto). QUEUE=name labels the Job for
  Kueue, which admits all its pods together (gang scheduling) or none;
- requests: POD_CPUS (default 8 per GPU) and POD_MEMORY (default: one bf16 copy of the model's weights, the node's share
  of offloaded optimizer states, 8 GiB per GPU), so the pods are not BestEffort (evicted first); the Hugging Face
  cache (HF_HOME) on the claim, so a restarted pod does not download the model again;
- POD_ENV='NCCL_SOCKET_IFNAME=eth0 ...' (variables for every pod), NODE_SELECTOR='key=value ...' and
  TOLERATIONS='key[=value]:Effect ...';
- the Hub and W&B tokens from the Secret SECRET (default disttrain-secrets, keys HF_TOKEN and WANDB_API_KEY,
  optional) by reference, never inline.
Bad inputs stop at render time in one line, nothing written: no IMAGE, NODES > 1 without PVC, a mesh that does not
fit GPUS x NODES (TP, SP, CP, EP, HSDP_REPLICAS), an unknown strategy, a recipe that does not validate.
Validated in the suite: the Job and Service by kubernetes-validate (the API's own schemas); the PyTorchJob's fields
against the names its published CRD defines (tests/test_clusters.py).
"""

from __future__ import annotations

import math
import re
import sys

import yaml

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.tools.cluster_launch import MOUNT, ClusterLaunch, checked_launch, emit, launch_parser

WORKDIR = "/workspace/disttrain"  # where the image holds this repository (and its .venv)
GRACE_MARGIN_S = 60  # a pod's grace period beyond SHUTDOWN_TIMEOUT: the step in flight, the entry's own exit
CPUS_PER_GPU = 8
HOST_GIB_PER_GPU = 8  # a rank's data loaders, CUDA context and pinned buffers
HF_HOME = f"{MOUNT}/.cache/huggingface"


def checked_inputs(args, extra: list[str]) -> ClusterLaunch:
    """What only Kubernetes needs (an image, a claim for several pods), then what every cluster launch needs."""
    if not args.image:
        raise DisttrainError("IMAGE is not set: the container image holding this repository and its .venv at "
                             f"{WORKDIR} (docs/clusters.md says how to build one), e.g. IMAGE=registry/disttrain:1")
    if args.nodes > 1 and not args.pvc:
        raise DisttrainError(f"NODES={args.nodes}: every pod writes checkpoints into output.dir, which must be on "
                             "storage they all mount; give PVC=<a ReadWriteMany PersistentVolumeClaim>")
    for given, pattern, example in ((args.env, r"[A-Za-z_][A-Za-z0-9_]*=.*", "NCCL_SOCKET_IFNAME=eth0"),
                                    (args.node_selector, r"[^=\s]+=[^=\s]*", "nvidia.com/gpu.product=H100"),
                                    (args.toleration, r"[^=:\s]+(=[^=:\s]*)?:(NoSchedule|PreferNoSchedule|NoExecute)",
                                     "nvidia.com/gpu:NoSchedule")):
        for item in given:
            if not re.fullmatch(pattern, item):
                raise DisttrainError(f"{item!r}: not in the form {example}")
    return checked_launch(args.recipe, args.strategy, args.nodes, args.gpus, extra, args.name)


def memory_gib(launch: ClusterLaunch, gpus: int, nodes: int) -> int:
    """A node's host memory: one bf16 copy of the weights (loading), its share of optimizer states offloaded to the
    host (make cost's figure), HOST_GIB_PER_GPU per rank; a model without a shipped config: the last alone, x 2."""
    from disttrain.tools import cost

    try:
        workload, _ = cost.workload_from_recipe(launch.recipe_path)
    except Exception:  # noqa: BLE001 -- a model `make cost` cannot size: a default, said in the module docstring
        return 2 * HOST_GIB_PER_GPU * gpus
    _, offloaded = cost.model_states_gb(workload, cost.MESHES.get(launch.strategy, launch.strategy), gpus * nodes)
    return math.ceil((2 * workload.params / 1e9 + offloaded / nodes) * 1e9 / 2**30 + HOST_GIB_PER_GPU * gpus)


def _requests(args, launch: ClusterLaunch) -> dict:
    gpus = {"nvidia.com/gpu": args.gpus}
    host = {"cpu": str(args.cpus or CPUS_PER_GPU * args.gpus),
            "memory": args.memory or f"{memory_gib(launch, args.gpus, args.nodes)}Gi"}
    return {"requests": {**host, **gpus}, "limits": dict(gpus)}


def _container(args, launch: ClusterLaunch, engine: str, container: str, port_name: str) -> dict:
    name = launch.name
    env = [{"name": "DISTTRAIN_ENGINE", "value": engine}, {"name": "DISTTRAIN_NODES", "value": str(args.nodes)},
           {"name": "DISTTRAIN_GPUS", "value": str(args.gpus)}]
    if engine == "kubernetes":
        env += [{"name": "DISTTRAIN_MASTER_ADDR", "value": f"{name}-0.{name}"},
                {"name": "DISTTRAIN_MASTER_PORT", "value": str(args.port)}]
    env += [{"name": "HF_HOME", "value": HF_HOME}]
    env += [{"name": k, "value": v} for k, v in (item.split("=", 1) for item in args.env)]
    env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": args.secret, "key": key, "optional": True}}}
            for key in ("HF_TOKEN", "WANDB_API_KEY")]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "outputs", "mountPath": MOUNT}]
    return {"name": container, "image": args.image, "imagePullPolicy": "IfNotPresent", "workingDir": WORKDIR,
            "command": launch.entry(".venv/bin/python", engine, shared=True),
            "env": env, "ports": [{"name": port_name, "containerPort": args.port}],
            "resources": _requests(args, launch), "volumeMounts": mounts}


def _pod_spec(args, launch: ClusterLaunch, containers: list[dict], **fields) -> dict:
    """What every pod of either kind has: the grace period, placement, the volumes."""
    spec = {**fields, "terminationGracePeriodSeconds": launch.shutdown_s + GRACE_MARGIN_S, "containers": containers,
            "volumes": _volumes(args)}
    if args.node_selector:
        spec["nodeSelector"] = dict(item.split("=", 1) for item in args.node_selector)
    if args.toleration:
        spec["tolerations"] = [_toleration(item) for item in args.toleration]
    return spec


def _toleration(item: str) -> dict:
    taint, effect = item.rsplit(":", 1)
    key, _, value = taint.partition("=")
    return {"key": key, "operator": "Equal" if value else "Exists", **({"value": value} if value else {}),
            "effect": effect}


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
           "spec": _pod_spec(args, launch, [_container(args, launch, "kubernetes", "train", "rendezvous")],
                             subdomain=name, restartPolicy="Never")}
    job_labels = {**labels(), **({"kueue.x-k8s.io/queue-name": args.queue} if args.queue else {})}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": job_labels},
           "spec": {"completionMode": "Indexed", "completions": args.nodes, "parallelism": args.nodes,
                    "backoffLimitPerIndex": args.max_restarts, "maxFailedIndexes": 0,
                    "podReplacementPolicy": "Failed",
                    "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [
                        {"type": "DisruptionTarget", "status": "True"}]}]},
                    "template": pod}}
    return [service, job]


def pytorchjob(args, launch: ClusterLaunch) -> list[dict]:
    """The training operator's names: the container `pytorch`, its port `pytorchjob-port` (the operator reads the
    Master's from it and sets MASTER_ADDR / MASTER_PORT, WORLD_SIZE and each pod's RANK)."""
    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": _pod_spec(args, launch, [_container(args, launch, "pytorchjob", "pytorch",
                                                                          "pytorchjob-port")])}}
    specs = {"Master": replica(1), **({"Worker": replica(args.nodes - 1)} if args.nodes > 1 else {})}
    # the operator counts restarts over all pods, and one failure restarts every pod: MAX_RESTARTS failures of the
    # whole job are MAX_RESTARTS x NODES restarts
    metadata = {"name": launch.name, **({"labels": {"kueue.x-k8s.io/queue-name": args.queue}} if args.queue else {})}
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
             "spec": {"runPolicy": {"backoffLimit": args.max_restarts * args.nodes, "cleanPodPolicy": "None"},
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
    parser.add_argument("--cpus", default="", help=f"CPU request per pod (default {CPUS_PER_GPU} per GPU)")
    parser.add_argument("--memory", default="", help="memory request per pod, e.g. 512Gi (default: sized from the "
                        "recipe's model and strategy)")
    parser.add_argument("--env", action="append", default=[], help="NAME=value for every pod (repeat)")
    parser.add_argument("--node-selector", action="append", default=[], help="key=value (repeat)")
    parser.add_argument("--toleration", action="append", default=[], help="key[=value]:Effect (repeat)")
    parser.add_argument("--queue", default="", help="a Kueue LocalQueue: all pods admitted together, or none")
    args, extra = parser.parse_known_args(argv)
    emit(yaml.safe_dump_all(render(args, extra), sort_keys=False), args.out,
         f"k8s: wrote {args.out} ({args.kind}, {args.nodes} x {args.gpus} GPUs); kubectl apply -f {args.out}")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

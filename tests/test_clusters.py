"""Launching where teams run their clusters (docs/clusters.md): the one entry every engine's nodes run
(disttrain/tools/cluster.py) read from each engine's variables, `make k8s`'s manifests, `make sky`'s task file,
`make ray`'s launcher.

- every engine's variables for the same node give the same `make train-*` command (one mapping, tested per engine);
  a variable an engine should have set is one line;
- the indexed Job and headless Service validate against the Kubernetes API's own schemas (kubernetes-validate,
  strict: no field the API does not define); the PyTorchJob's own fields are the ones its published CRD defines
  (kubeflow.org/v1, training-operator's manifests/base/crds/kubeflow.org_pytorchjobs.yaml) and its pod templates
  validate as Kubernetes PodTemplates; the SkyPilot task holds only fields SkyPilot's task reference documents
  (checked once with SkyPilot 0.14.1's own loader, `sky.Task.from_yaml`, outside the suite: its install is a web
  server's worth of dependencies);
- bad inputs stop at render time in one line and write nothing;
- two loopback "nodes" run by the entry under the Kubernetes Job's variables and under the PyTorchJob's (whose
  WORLD_SIZE and RANK name pods), and by the Ray launcher on a local Ray cluster of 2 CPU workers, train like the
  two-node loopback run and the one-node run of the same recipe (tests/test_multinode.py's claim, rel 1e-5);
  SkyPilot's and SLURM's variables give the very command the Job's give (above).
"""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
import yaml

from conftest import REPO, free_port
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.recipe.schema import load_recipe
from disttrain.tools import cluster, k8s, sky
from strategy_runs import matrix_recipe, small_data, strategy_run

NODE = cluster.Node(nodes=2, rank=1, master_addr="10.0.0.5", master_port=29500, gpus=8)
ENGINE_ENV = {
    "kubernetes": {"JOB_COMPLETION_INDEX": "1", "DISTTRAIN_NODES": "2", "DISTTRAIN_GPUS": "8",
                   "DISTTRAIN_MASTER_ADDR": "10.0.0.5"},
    "pytorchjob": {"DISTTRAIN_ENGINE": "pytorchjob", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
                   "MASTER_PORT": "29500", "DISTTRAIN_GPUS": "8"},
    "skypilot": {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
                 "SKYPILOT_NUM_GPUS_PER_NODE": "8"},
    "slurm": {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "10.0.0.5", "SLURM_GPUS_ON_NODE": "8"},
    "disttrain": {"DISTTRAIN_NODE_RANK": "1", "DISTTRAIN_NODES": "2", "DISTTRAIN_MASTER_ADDR": "10.0.0.5",
                  "DISTTRAIN_GPUS": "8"},
}


@pytest.mark.parametrize("engine", list(ENGINE_ENV))
def test_every_engines_variables_give_the_same_node_and_the_same_launch(engine):
    found, node = cluster.node_of(ENGINE_ENV[engine])
    assert (found, node) == (engine, NODE)
    cmd = cluster.command(node, "fsdp_ep", "recipes/qwen3-30b-a3b/full_sft_ep.yaml", ["EP=8", "training.max_steps=5"])
    assert cmd == ["make", "-s", "-o", "tiny", "train-fsdp-ep", "NODES=2", "NODE_RANK=1", "GPUS=8",
                   "MASTER_ADDR=10.0.0.5", "MASTER_PORT=29500", "EP=8", "RECIPE=recipes/qwen3-30b-a3b/full_sft_ep.yaml",
                   "ARGS=training.max_steps=5"]


@pytest.mark.parametrize("env, said", [
    ({"JOB_COMPLETION_INDEX": "0", "DISTTRAIN_NODES": "2", "DISTTRAIN_GPUS": "8"},
     "kubernetes: the variable DISTTRAIN_MASTER_ADDR is not set"),
    ({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "two", "SKYPILOT_NODE_IPS": "a",
      "SKYPILOT_NUM_GPUS_PER_NODE": "8"}, "skypilot: SKYPILOT_NUM_NODES='two' is not a whole number"),
    ({"DISTTRAIN_NODE_RANK": "2", "DISTTRAIN_NODES": "2", "DISTTRAIN_MASTER_ADDR": "a", "DISTTRAIN_GPUS": "1"},
     "node rank 2 is not below the 2 nodes"),
    ({}, "no cluster engine's variables are set on this node"),
])
def test_a_node_missing_what_its_engine_sets_is_one_line(env, said):
    with pytest.raises(DisttrainError, match=said) as info:
        cluster.node_of(env)
    assert "\n" not in str(info.value)


def _k8s(**given):
    args = dict(recipe="recipes/llama-3.1-8b/full_sft_fsdp.yaml", strategy="fsdp", nodes=2, gpus=8, image="reg/d:1",
                pvc="outputs", kind="job", name="", shm="64Gi", secret="disttrain-secrets", max_restarts=3,
                port=29500, cpus="", memory="", env=[], node_selector=[], toleration=[], queue="")
    args.update(given)
    extra = args.pop("extra", [])
    return k8s.render(SimpleNamespace(**args), extra)


@pytest.mark.parametrize("strategy, recipe, extra", [
    ("fsdp", "recipes/llama-3.1-8b/full_sft_fsdp.yaml", []),
    ("fsdp_ep", "recipes/qwen3-30b-a3b/full_sft_ep.yaml", ["EP=8", "HSDP_REPLICAS=2"]),
    ("zero3", "recipes/qwen2.5-7b/lora_sft.yaml", ["training.max_steps=100"]),
])
def test_the_indexed_job_and_its_service_validate_against_the_kubernetes_api(strategy, recipe, extra):
    import kubernetes_validate

    service, job = _k8s(strategy=strategy, recipe=recipe, extra=extra)
    for doc in (service, job):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)  # raises on any field the API does not define
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 2, 2)
    assert pod["subdomain"] == service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    container = pod["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["DISTTRAIN_MASTER_ADDR"] == f"{name}-0.{name}"  # pod 0's name under the headless service
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "disttrain-secrets", "key": "HF_TOKEN", "optional": True}}
    assert env["HF_HOME"].startswith("/outputs/")  # the model downloaded once, on the claim, not per pod start
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    requests = container["resources"]["requests"]  # Burstable, not BestEffort (evicted first)
    assert requests["nvidia.com/gpu"] == 8 and int(requests["cpu"]) >= 8 and requests["memory"].endswith("Gi")
    assert {v["name"]: v for v in pod["volumes"]}["outputs"]["persistentVolumeClaim"] == {"claimName": "outputs"}
    command = container["command"]
    assert command[:3] == [".venv/bin/python", "-m", "disttrain.tools.cluster"] and command[-1].startswith(
        "output.dir=/outputs/")
    assert [a for a in extra if a not in command] == []
    # kubelet's SIGKILL comes after the launcher's own; a restarted pod outwaits the survivors' collective timeout
    timeouts = dict(a.split("=", 1) for a in command if a.startswith(("SHUTDOWN_TIMEOUT=", "RDZV_TIMEOUT=")))
    assert pod["terminationGracePeriodSeconds"] > int(timeouts["SHUTDOWN_TIMEOUT"]) == 600
    assert int(timeouts["RDZV_TIMEOUT"]) > load_recipe(REPO / recipe, [a for a in extra if "=" in a and
                                                                         not a[0].isupper()]).distributed.timeout_s


def _job_survives(job: dict, incidents: list[dict[int, str | None]]) -> bool:
    """The Job controller's accounting as Kubernetes documents it (batch/v1, "Pod failure policy" and "Backoff limit
    per index"): each failed pod matches the first podFailurePolicy rule whose condition it has (Ignore: not
    counted), else counts against its index; an index failing more than backoffLimitPerIndex times is failed, and
    more than maxFailedIndexes failed indexes fail the Job. Without backoffLimitPerIndex, every failed pod counts
    against backoffLimit. An incident maps each failed pod's index to its condition (None: it exited non-zero)."""
    spec = job["spec"]
    ignored = {c["type"] for rule in spec.get("podFailurePolicy", {}).get("rules", []) if rule["action"] == "Ignore"
               for c in rule.get("onPodConditions", [])}
    per_index, total = {}, 0
    for incident in incidents:
        for index, condition in incident.items():
            if condition in ignored:
                continue
            per_index[index] = per_index.get(index, 0) + 1
            total += 1
    if "backoffLimitPerIndex" in spec:
        failed = [i for i, n in per_index.items() if n > spec["backoffLimitPerIndex"]]
        return len(failed) <= spec.get("maxFailedIndexes", len(per_index))
    return total <= spec.get("backoffLimit", 6)


def test_the_four_pod_job_survives_max_restarts_whole_job_failures_and_any_number_of_preemptions():
    """MAX_RESTARTS=3 on 4 nodes: a lost rank fails every pod once (the others at their next collective), three
    times over, and the Job goes on; a fourth time it fails. Preemptions and evictions (DisruptionTarget) are not
    counted. A replacement pod starts only when the old one has exited (it may still be writing the checkpoint).
    Control: the old manifest's backoffLimit, summed over pods, is spent by the first failure."""
    _, job = _k8s(nodes=4, max_restarts=3)
    whole_job_failure = {i: None for i in range(4)}
    assert _job_survives(job, [whole_job_failure] * 3)
    assert not _job_survives(job, [whole_job_failure] * 4)
    assert _job_survives(job, [{i: "DisruptionTarget" for i in range(4)}] * 20 + [whole_job_failure] * 3)
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    assert not _job_survives({"spec": {"backoffLimit": 3}}, [whole_job_failure])
    (pytorchjob,) = _k8s(kind="pytorchjob", nodes=4, max_restarts=3)  # the operator counts restarts over all pods
    assert _job_survives({"spec": pytorchjob["spec"]["runPolicy"]}, [whole_job_failure] * 3)


def test_pod_placement_environment_and_queue_come_from_the_make_variables():
    _, job = _k8s(env=["NCCL_SOCKET_IFNAME=eth0"], node_selector=["gpu=h100"], queue="team-a",
                  toleration=["nvidia.com/gpu:NoSchedule", "dedicated=train:NoExecute"], cpus="48", memory="900Gi")
    pod = job["spec"]["template"]["spec"]
    import kubernetes_validate
    kubernetes_validate.validate(job, "1.33.0", strict=True)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoExecute"}]
    container = pod["containers"][0]
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in container["env"]
    assert (container["resources"]["requests"]["cpu"], container["resources"]["requests"]["memory"]) == ("48", "900Gi")
    with pytest.raises(DisttrainError, match="'gpu:NoSchedule:x': not in the form"):
        _k8s(toleration=["gpu:NoSchedule:x"])


# PyTorchJob kubeflow.org/v1: spec fields as its published CRD names them (training-operator,
# manifests/base/crds/kubeflow.org_pytorchjobs.yaml), and the operator's names for the container and its port
PYTORCHJOB_SPEC = {"elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"}
RUN_POLICY = {"activeDeadlineSeconds", "backoffLimit", "cleanPodPolicy", "managedBy", "schedulingPolicy", "suspend",
              "ttlSecondsAfterFinished"}
REPLICA_SPEC = {"replicas", "restartPolicy", "template"}


def test_the_pytorchjob_has_the_crds_fields_and_pod_templates_kubernetes_validates():
    import kubernetes_validate

    (job,) = _k8s(kind="pytorchjob", nodes=3)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert set(job["spec"]) <= PYTORCHJOB_SPEC and set(job["spec"]["runPolicy"]) <= RUN_POLICY
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("All", "Running", "None")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) \
        == (1, 2)
    for spec in replicas.values():
        assert set(spec) <= REPLICA_SPEC and spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": spec["template"]}, "1.30.0", strict=True)
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"


# SkyPilot's task YAML reference (docs.skypilot.co, "YAML Configuration"): the fields this file may hold
SKY_TASK = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup", "run", "config"}
SKY_RESOURCES = {"infra", "cloud", "region", "zone", "accelerators", "accelerator_args", "cpus", "memory",
                 "instance_type", "use_spot", "job_recovery", "disk_size", "disk_tier", "network_tier", "ports",
                 "labels", "image_id", "autostop", "any_of", "ordered"}
SKY_RECOVERY = {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}
SKY_MOUNT = {"name", "source", "store", "mode", "persistent"}


def _sky(**given):
    args = dict(recipe="recipes/llama-3.1-8b/full_sft_fsdp.yaml", strategy="fsdp", nodes=2, gpus=8, accelerator="H100",
                bucket="train-outputs", spot=1, max_restarts=3, port=29500, name="")
    args.update(given)
    extra = args.pop("extra", [])
    return sky.render(SimpleNamespace(**args), extra)


def test_the_skypilot_task_holds_documented_fields_and_runs_the_entry_on_every_node():
    task = yaml.safe_load(yaml.dump(_sky(extra=["training.max_steps=10"]), Dumper=sky._Dumper))
    assert set(task) <= SKY_TASK and set(task["resources"]) <= SKY_RESOURCES
    assert set(task["resources"]["job_recovery"]) <= SKY_RECOVERY
    assert task["resources"]["accelerators"] == "H100:8" and task["resources"]["use_spot"] is True
    assert task["num_nodes"] == 2 and task["workdir"] == "."
    (mount, spec), = task["file_mounts"].items()
    # MOUNT_CACHED: SkyPilot's mode for checkpoints (plain MOUNT takes no appends: metrics.jsonl, no renames)
    assert mount == "/outputs" and set(spec) <= SKY_MOUNT and spec["mode"] == "MOUNT_CACHED"
    assert task["setup"].strip() == "make setup GPU=1"
    assert "disttrain.tools.cluster --engine skypilot --strategy fsdp" in task["run"]
    assert "training.max_steps=10" in task["run"] and "output.dir=/outputs/" in task["run"]


@pytest.mark.parametrize("render, given, said", [
    (_k8s, dict(image=""), "IMAGE is not set"),
    (_k8s, dict(pvc=""), "NODES=2: every pod writes checkpoints into output.dir"),
    (_k8s, dict(strategy="fsdp_tp", extra=["TP=3"]), "TP=3 does not divide GPUS=8"),
    (_k8s, dict(strategy="fsdp_ep", extra=["EP=16"]), "EP=16 does not divide the GPUs of a replica"),
    (_k8s, dict(strategy="fsdp_tpp"), "STRATEGY=fsdp_tpp: no accelerate_configs/fsdp_tpp.yaml"),
    (_k8s, dict(extra=["training.lrr=1"]), "training.lrr"),
    (_k8s, dict(name="My_Run"), "NAME='My_Run'"),
    (_sky, dict(bucket=""), "checkpoints must outlive a node"),
    (_sky, dict(nodes=1, bucket="", spot=1), "SPOT=1: checkpoints must outlive a node"),
    (_sky, dict(accelerator="H100:8"), "ACCELERATOR='H100:8'"),
    (_sky, dict(strategy="zero3_ulysses", extra=["SP=3"]), "SP=3 does not divide GPUS x NODES = 16"),
])
def test_bad_inputs_stop_at_render_time_in_one_line(render, given, said):
    with pytest.raises(DisttrainError, match=said) as info:
        render(**given)
    assert "\n" not in str(info.value)


def test_make_k8s_without_an_image_writes_nothing_and_says_one_line(tmp_path):
    out = tmp_path / "job.yaml"
    proc = subprocess.run(["make", "-s", "k8s", "NODES=2", "GPUS=8", "STRATEGY=fsdp", "PVC=outputs", f"OUT={out}",
                           "RECIPE=recipes/llama-3.1-8b/full_sft_fsdp.yaml"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and not out.exists()
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        line for line in proc.stderr.splitlines() if "IMAGE is not set" in line]


def _same_as_the_two_node_run(runs, tiny_model_dir, out):
    one = strategy_run(runs, tiny_model_dir, "ddp", False)
    single = [r["loss"] for r in read_metrics(one.out) if "loss" in r]
    multi = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(multi) == 10 and multi == pytest.approx(single, rel=1e-5)
    assert (out / "final" / "model.safetensors").is_file()


def _pod_env(engine: str, rank: int, port: str) -> dict:
    """What a pod of `make k8s`'s Job (or PyTorchJob) has: Kubernetes' (or the training operator's) variables and
    the manifest's, on loopback. The operator's WORLD_SIZE / RANK / PET_* describe pods, not processes: the entry
    must keep them from torchrun's workers."""
    if engine == "kubernetes":
        return {"JOB_COMPLETION_INDEX": str(rank), "DISTTRAIN_NODES": "2", "DISTTRAIN_GPUS": "1",
                "DISTTRAIN_MASTER_ADDR": "127.0.0.1", "DISTTRAIN_MASTER_PORT": port}
    return {"DISTTRAIN_ENGINE": "pytorchjob", "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "PET_NNODES": "2", "PET_NODE_RANK": str(rank), "DISTTRAIN_GPUS": "1"}


# the first save of a run sleeps this long (tests/slow_save): the signal arrives while a run is surely mid-way
SLOW_SAVE = {"PYTHONPATH": str(REPO / "tests" / "slow_save"), "DISTTRAIN_TEST_SAVE_DELAY_S": "3"}


def _start_pods(engine: str, recipe, logs: list, env: dict | None = None) -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen([sys.executable, "-m", "disttrain.tools.cluster", "--strategy", "ddp", "--recipe",
                              str(recipe), "RDZV_TIMEOUT=120"], cwd=REPO, stdout=log.open("w"),
                             stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **_pod_env(engine, i, port), **(env or {})})
            for i, log in enumerate(logs)]


def _pods_finish(engine: str, recipe, logs: list) -> list[str]:
    """The pods run to the end (exit 0 each); their logs."""
    pods = _start_pods(engine, recipe, logs)
    for pod in pods:
        pod.wait(timeout=300)
    texts = [log.read_text() for log in logs]
    assert [pod.returncode for pod in pods] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    return texts


def _when_a_save_is_under_way(logs: list, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and not any(log.exists() and "checkpoint save delayed" in log.read_text()
                                             for log in logs):
        time.sleep(0.1)


def _stopped_with_a_checkpoint(text: str, out) -> int:
    """The step the workers stopped at, after checking its checkpoint is complete."""
    stopped = [line for line in text.splitlines() if line.startswith("stopped at step")]
    assert stopped, text[-3000:]
    step = int(stopped[0].split()[3].split("/")[0])
    assert (out / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file(), text[-3000:]
    return step


def _all_exited(processes: list[psutil.Process]) -> list[str]:
    """The processes of a run still alive (a zombie has exited: only its exit status is left)."""
    alive = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.cmdline()[:4]))
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.launch
def test_sigterm_to_each_pods_entry_checkpoints_ends_every_process_and_the_pods_resume(runs, tiny_model_dir, tmp_path):
    """Two "pods" of `make k8s`'s Job on loopback, each signalled as kubelet signals a container (SIGTERM to its main
    process only, the entry) while the run is mid-way: both exit with 143 within 2 minutes, every process under
    them (make, the launcher, the workers) has exited, the workers' checkpoint is complete; the same pods started
    again resume from it and the run ends like the two-node run, step for step."""
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "pods")
    logs = [tmp_path / f"pod{i}.log" for i in (0, 1)]
    pods = _start_pods("kubernetes", recipe, logs, SLOW_SAVE)
    try:
        _when_a_save_is_under_way(logs)
        under = [p for pod in pods for p in psutil.Process(pod.pid).children(recursive=True)]
        assert len(under) >= 6, [p.cmdline()[:4] for p in under]  # make, the shell, the launcher, a worker, each
        for pod in pods:
            pod.send_signal(signal.SIGTERM)
        for pod in pods:
            pod.wait(timeout=120)
    finally:
        for pod in pods:
            pod.kill()
    texts = [log.read_text() for log in logs]
    assert [pod.returncode for pod in pods] == [143, 143], texts[0][-3000:] + texts[1][-3000:]
    assert _all_exited(under) == [] and "every process of the run has exited" in texts[1]
    step = _stopped_with_a_checkpoint(texts[0], tmp_path / "pods")
    texts = _pods_finish("kubernetes", recipe, [tmp_path / f"pod{i}-again.log" for i in (0, 1)])
    assert f"step-{step:08d} at step {step}/" in texts[0] and "cluster: kubernetes node 1 of 2" in texts[1]
    _same_as_the_two_node_run(runs, tiny_model_dir, tmp_path / "pods")


@pytest.mark.launch
def test_two_pytorchjob_pods_train_like_the_two_node_run(runs, tiny_model_dir, tmp_path):
    """The entry as each pod of the PyTorchJob runs it, with the variables the training operator sets there (its
    WORLD_SIZE / RANK / PET_* describe pods: the entry keeps them from torchrun's workers), on loopback."""
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "pods")
    texts = _pods_finish("pytorchjob", recipe, [tmp_path / f"pod{i}.log" for i in (0, 1)])
    assert "cluster: pytorchjob node 1 of 2" in texts[1] and "processes=2" in texts[0]
    _same_as_the_two_node_run(runs, tiny_model_dir, tmp_path / "pods")


@pytest.mark.launch
def test_a_local_ray_cluster_signalled_checkpoints_and_runs_again_like_the_two_node_run(runs, tiny_model_dir,
                                                                                         tmp_path):
    """`make ray`'s launcher (in a process of its own: Ray's driver state stays out of the test process) on a local
    Ray cluster of 2 CPU workers, SIGTERM to the launcher mid-run: every node's workers checkpoint and exit, the
    launcher exits with 143; started again it resumes and ends like the two-node run."""
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "ray")
    command = [sys.executable, "-m", "disttrain.tools.ray_launch", "--cpu", "--nodes", "2", "--gpus", "1",
               "--strategy", "ddp", "--recipe", str(recipe), "--log-dir", str(tmp_path / "logs"), "RDZV_TIMEOUT=120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / "logs" / f"ray-node-{i}.log" for i in (0, 1)]
    with (tmp_path / "first.log").open("w") as out:
        first = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**env, **SLOW_SAVE})
    try:
        _when_a_save_is_under_way(logs)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    finally:
        first.kill()
    texts = [log.read_text() for log in logs]
    assert first.returncode == 143, (tmp_path / "first.log").read_text()[-2000:] + texts[0][-3000:]
    step = _stopped_with_a_checkpoint(texts[0], tmp_path / "ray")
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    texts = [log.read_text() for log in logs]
    assert proc.returncode == 0, proc.stderr[-2000:] + texts[0][-3000:] + texts[1][-3000:]
    assert "ray: 2 nodes finished" in proc.stdout and f"step-{step:08d} at step {step}/" in texts[0]
    assert "cluster: disttrain node 1 of 2" in texts[1] and "processes=2" in texts[0]
    _same_as_the_two_node_run(runs, tiny_model_dir, tmp_path / "ray")

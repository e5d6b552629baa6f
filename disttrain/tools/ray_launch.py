"""`make ray`: the training on a Ray cluster's nodes, each node running the one cluster entry.

    make ray NODES=2 GPUS=8 RECIPE=recipes/llama-3.1-8b/full_sft_fsdp.yaml STRATEGY=fsdp     # on the head node
    python -m disttrain.tools.ray_launch --nodes 2 --gpus 8 --strategy fsdp --recipe ...  # RAY_ADDRESS: the cluster

How: a placement group of NODES bundles of GPUS GPUs, spread over different nodes (STRICT_SPREAD), one Ray actor
in each; the first actor's node address is the rendezvous; every actor then runs disttrain/tools/cluster.py with
the `disttrain` engine's variables (its node rank, the nodes, that address, a port), which runs `make
train-<strategy>` there: accelerate starts one process per GPU of the bundle (Ray sets CUDA_VISIBLE_DEVICES to
them), exactly as under SLURM, Kubernetes or SkyPilot. Why one actor per node and not Ray Train's one worker per
GPU: accelerate computes each process's environment itself from the config file (FSDP, DeepSpeed, the mesh), and
torchrun's restarts and preemption signals stay what every other engine gets; a per-GPU Ray worker would have to
reproduce both. The repository (with its .venv) must be at the same path on every node (a shared filesystem or
the cluster's image), and output.dir on storage every node sees. Each node's output goes to
<--log-dir>/ray-node-<rank>.log (default logs/) and the launcher's exit status is the first non-zero node's.
No wall-clock limit by default (`--timeout-s`, RAY_TIMEOUT in make: then every node is stopped as on a SIGTERM). A
SIGTERM / SIGINT to this launcher (or `make ray`) reaches every node's entry, which forwards it to its launch
(disttrain/tools/supervise.py): the workers checkpoint, every node exits, and the launcher exits with 143 (run it
again to resume).

`--cpu`: bundles of one CPU and `GPUS` processes each (a local test cluster: `ray.init` on this machine when no
RAY_ADDRESS is set); tests/test_clusters.py trains two such "nodes" like the two-node loopback run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error

REPO = Path(__file__).resolve().parents[2]


class NodeRunner:
    """One per node (a Ray actor, two calls at a time: `stop` arrives while `run` waits): where it is, and the
    entry run there."""

    def __init__(self):
        self._entry: subprocess.Popen | None = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:  # a port free on this node for the rendezvous
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, cmd: list[str], env: dict[str, str], log: str) -> int:
        with open(log, "w") as out:
            self._entry = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=out,
                                           stderr=subprocess.STDOUT)
            return self._entry.wait()

    def stop(self, signum: int) -> None:
        """The signal to the node's entry, which forwards it to its launch and waits for the checkpoint."""
        if self._entry is not None and self._entry.poll() is None:
            self._entry.send_signal(signum)


def launch(strategy: str, recipe: str, nodes: int, gpus: int, extra: list[str], log_dir: Path,
           cpu: bool = False, timeout_s: float | None = None) -> list[int]:
    """Every node's exit status, in node-rank order; a SIGTERM / SIGINT meanwhile (or `timeout_s` passing) is
    forwarded to every node, whose exit is then waited for."""
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise DisttrainError("make ray needs Ray: make setup EXTRAS=test,ray (or pip install 'ray>=2.40')") from None
    # the running cluster (RAY_ADDRESS, or the one `ray start --head` left on this machine); --cpu without one: a
    # local instance of NODES CPUs
    local = cpu and not os.environ.get("RAY_ADDRESS")
    ray.init(**({"num_cpus": nodes, "include_dashboard": False} if local else {}), log_to_driver=False)
    try:
        bundle = {"CPU": 1} if cpu else {"CPU": 1, "GPU": gpus}
        group = placement_group([bundle] * nodes, strategy="PACK" if cpu else "STRICT_SPREAD")
        if not group.wait(timeout_seconds=120):
            raise DisttrainError(f"ray: the cluster has no room for {nodes} nodes of {bundle} "
                                 f"({'one machine' if cpu else 'STRICT_SPREAD: one bundle per node'}); "
                                 f"`ray status` says what it has")
        actor = ray.remote(NodeRunner)
        runners = [actor.options(max_concurrency=2, num_cpus=1, num_gpus=0 if cpu else gpus, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))).remote() for i in range(nodes)]
        host, port = ray.get(runners[0].address.remote())
        entry = [sys.executable, "-m", "disttrain.tools.cluster", "--engine", "disttrain", "--strategy", strategy,
                 "--recipe", recipe, *extra]
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {"DISTTRAIN_NODES": str(nodes), "DISTTRAIN_MASTER_ADDR": host, "DISTTRAIN_MASTER_PORT": str(port),
               "DISTTRAIN_GPUS": str(gpus), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        runs = [r.run.remote(entry, {**env, "DISTTRAIN_NODE_RANK": str(i)}, str(log_dir / f"ray-node-{i}.log"))
                for i, r in enumerate(runners)]
        return _wait_forwarding(runners, runs, timeout_s)
    finally:
        ray.shutdown()


def _wait_forwarding(runners, runs, timeout_s: float | None) -> list[int]:
    """Every node's run waited for; a signal to this process (or the timeout passing) is sent on to every node's
    entry once, and the runs are still waited for: they end when the workers have checkpointed. The handler only
    records the signal: the loop, not the handler, talks to Ray."""
    import ray

    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stopped = False
    try:
        while len(ray.wait(runs, num_returns=len(runs), timeout=1.0)[0]) < len(runs):
            if not stopped and deadline is not None and time.monotonic() > deadline:
                print(f"ray: --timeout-s {timeout_s:.0f} passed; stopping every node", flush=True)
                received.append(signal.SIGTERM)
            if received and not stopped:
                ray.get([r.stop.remote(received[0]) for r in runners])
                stopped = True
        codes = ray.get(runs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return [128 + received[0] if received and code == 0 else code for code in codes]


def main(argv=None) -> None:
    from disttrain.tools.cluster_launch import launch_parser

    parser = launch_parser(__doc__, nodes=2, files=False)
    parser.add_argument("--cpu", action="store_true", help="CPU bundles (a local test cluster)")
    parser.add_argument("--log-dir", default="logs", help="where each node's output goes")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop every node (as on SIGTERM) after this "
                        "long; default: no limit")
    args, extra = parser.parse_known_args(argv)
    codes = launch(args.strategy, args.recipe, args.nodes, args.gpus, extra, Path(args.log_dir), args.cpu,
                   args.timeout_s)
    failed = [i for i, code in enumerate(codes) if code]
    print(f"ray: {args.nodes} nodes finished" + (f"; node(s) {failed} failed: {args.log_dir}/ray-node-N.log"
                                                  if failed else ""))
    sys.exit(codes[failed[0]] if failed else 0)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

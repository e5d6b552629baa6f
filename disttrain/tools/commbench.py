"""Collective bandwidth, measured the way nccl-tests define it; started by `make doctor` under torchrun.

    torchrun --nproc_per_node N -m disttrain.tools.commbench --out result.json

For each size: warm-up, barrier, `iters` timed calls, the slowest rank's mean time t.
    algbw = size / t
    busbw = algbw * 2(n-1)/n   for all_reduce   (each byte crosses the ring twice)
    busbw = algbw * (n-1)/n    for all_gather   (size = the gathered output)
busbw is comparable to the link's bandwidth whatever n is. NCCL on GPUs, gloo on CPU processes.
Every rank also reports its host and software versions; rank 0 writes everything to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from disttrain.runtime import guards

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


def local_versions() -> dict:
    info = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": None, "driver": None, "gpu": None}
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpu"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return info


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _op(name: str, world: int, size_bytes: int, device):
    n = max(world, size_bytes // 4 // world * world)  # float32 elements, divisible by the world size
    if name == "all_reduce":
        x = torch.ones(n, device=device)
        return lambda: dist.all_reduce(x), n * 4
    chunk = torch.ones(n // world, device=device)
    out = [torch.empty_like(chunk) for _ in range(world)]
    return lambda: dist.all_gather(out, chunk), n * 4


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure(name: str, size_bytes: int, device, budget_s: float = 0.25, warmup: int = 3) -> dict:
    world = dist.get_world_size()
    call, actual = _op(name, world, size_bytes, device)
    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier()
    started = time.perf_counter()
    call()
    _sync(device)
    once = _slowest(time.perf_counter() - started, device)
    iters = int(min(50, max(3, budget_s / max(once, 1e-6))))  # same count on every rank (from the max)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    t = _slowest((time.perf_counter() - started) / iters, device)
    algbw = actual / t / 1e9
    return {"op": name, "bytes": actual, "iters": iters, "time_us": t * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * BUS_FACTOR[name](world)}


def sizes(max_bytes: int, min_bytes: int = 1024) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-bytes", type=int, default=None, help="largest message (default 1 GiB GPU, 16 MiB CPU)")
    parser.add_argument("--timeout-s", type=int, default=120)
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    versions = [None] * world
    dist.all_gather_object(versions, {**local_versions(), "rank": rank})
    max_bytes = args.max_bytes or (1 << 30 if gpu else 16 << 20)
    results = [measure(op, size, device) for op in ("all_reduce", "all_gather") for size in sizes(max_bytes)]
    if rank == 0:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 0)) or len({v["host"] for v in versions})
        payload = {"backend": backend, "world_size": world, "nodes": nodes, "device": str(device),
                   "versions": versions, "results": results}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, args.out)
    dist.barrier()
    guards.hold_until_exit(dist.group.WORLD)  # freed at os._exit, not by destroy below: guards says why
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the result is written: skip interpreter teardown, where a finished gloo rank can abort (see train.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

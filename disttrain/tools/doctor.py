"""`make doctor`: is this machine (and this cluster) ready to train? Each check says PASS / WARN / FAIL and,
when it is not a PASS, the one-line fix.

    python -m disttrain.tools.doctor [--recipe R] [--nproc N] [--json]
    python -m disttrain.tools.doctor --nodes 2 --node-rank R --master-addr HOST --master-port P   (on every node)

Exit status: 0 when nothing blocks training (warnings allowed), 1 when a check FAILs.
The collective bandwidth test really launches N processes (torchrun + disttrain/tools/commbench.py): NCCL on GPUs,
gloo on CPU. With several nodes it runs across them and compares every rank's torch/CUDA/NCCL/driver.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from disttrain.runtime.launcher import REPO, free_port

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
GIB = 1 << 30


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- software
CUDA_INSTALL = "make setup GPU=1 TORCH_INDEX=https://download.pytorch.org/whl/cu128 (a CUDA build: the cuXYZ at or " \
    "below nvidia-smi's 'CUDA Version')"
CPU_INSTALL = "make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu"


def nvidia_gpus() -> int:
    """GPUs the NVIDIA driver lists (nvidia-smi -L), whatever torch was built for; 0 without a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def check_torch_build(gpus: int, expect_gpu: bool = False) -> Check:
    """A CPU build of torch on a machine with NVIDIA GPUs (or where GPU=1 asks for CUDA) trains on the CPU:
    say so before the first run, not on it. A CUDA build without GPUs works, it is only large."""
    import torch

    version, cuda = torch.__version__, torch.version.cuda
    if cuda is None and (gpus or expect_gpu):
        where = f"this machine has {gpus} NVIDIA GPU(s) (nvidia-smi)" if gpus else "GPU=1 asks for a CUDA build"
        return Check("torch", FAIL, f"torch {version} is a CPU build but {where}: training would run on the "
                     "CPU", CUDA_INSTALL)
    if cuda is None:
        return Check("torch", PASS, f"torch {version}, a CPU build (no NVIDIA GPU here)")
    if not gpus:
        return Check("torch", PASS, f"torch {version}, a CUDA {cuda} build (no NVIDIA GPU here: it runs on the "
                     f"CPU; the smaller CPU build: {CPU_INSTALL})")
    return Check("torch", PASS, f"torch {version}, a CUDA {cuda} build, {gpus} NVIDIA GPU(s)")


def check_torch() -> list[Check]:
    import torch

    checks = [Check("python", PASS, sys.version.split()[0]), check_torch_build(nvidia_gpus())]
    if not torch.cuda.is_available():
        if torch.version.cuda is not None:
            checks.append(Check("gpu", WARN, "no CUDA GPU visible: runs use CPU processes over gloo",
                                "check nvidia-smi and CUDA_VISIBLE_DEVICES"))
        elif checks[-1].status == PASS:
            checks.append(Check("gpu", WARN, "no CUDA GPU: runs use CPU processes over gloo (tests, preflight)"))
        return checks
    driver, driver_cuda = _driver_versions()
    runtime = torch.version.cuda
    status, fix = PASS, ""
    if driver_cuda and runtime and _as_tuple(driver_cuda) < _as_tuple(runtime):
        status, fix = FAIL, (f"the driver supports CUDA up to {driver_cuda} but torch was built for {runtime}: "
                             "upgrade the driver or install a torch build for an older CUDA")
    checks.append(Check("cuda runtime vs driver", status,
                        f"torch CUDA {runtime}, driver {driver or '?'} (supports CUDA {driver_cuda or '?'})", fix))
    checks.append(Check("nccl", PASS, ".".join(map(str, torch.cuda.nccl.version()))))
    checks.extend(check_gpus())
    return checks


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def _driver_versions() -> tuple[str | None, str | None]:
    """(driver version, highest CUDA version it supports) from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def check_gpus() -> list[Check]:
    import torch

    checks = []
    count = torch.cuda.device_count()
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        with torch.cuda.device(i):
            bf16 = torch.cuda.is_bf16_supported()
        status, fix = PASS, ""
        if free < 0.9 * total:
            status, fix = WARN, (f"{(total - free) / GIB:.1f} GiB already in use: another process holds this GPU "
                                 "(nvidia-smi shows which); it will OOM first")
        if not bf16:
            status, fix = WARN, "no bf16 on this GPU: set training.mixed_precision=fp16 (and model.dtype=float16)"
        checks.append(Check(f"gpu {i}", status, f"{props.name}, sm_{props.major}{props.minor}, "
                            f"{free / GIB:.1f}/{total / GIB:.1f} GiB free, bf16={'yes' if bf16 else 'no'}", fix))
    if count > 1:
        rows = []
        missing = []
        for i in range(count):
            row = []
            for j in range(count):
                ok = i == j or torch.cuda.can_device_access_peer(i, j)
                row.append("X" if i == j else ("Y" if ok else "n"))
                if not ok:
                    missing.append((i, j))
            rows.append("".join(row))
        status = WARN if missing else PASS
        checks.append(Check("p2p access", status, "matrix " + " ".join(rows),
                            "some GPU pairs cannot reach each other directly (traffic goes through host memory): "
                            "check `nvidia-smi topo -m`, ACS/IOMMU settings, NCCL_P2P_DISABLE" if missing else ""))
    return checks


LIBRARIES = [  # (distribution, needed for, required?)
    ("accelerate", "every run", True), ("transformers", "every run", True), ("datasets", "data loading", True),
    ("peft", "LoRA / QLoRA recipes", True), ("deepspeed", "zero1/2/3 configs", False),
    ("bitsandbytes", "QLoRA and adamw_8bit", False), ("flash-attn", "attn_implementation=flash_attention_2", False),
    ("wandb", "logging.report_to=[wandb]", False), ("tensorboard", "logging.report_to=[tensorboard]", False),
]


def check_libraries() -> list[Check]:
    checks = []
    for name, used_for, required in LIBRARIES:
        version = _version(name)
        if version:
            checks.append(Check(name, PASS, version))
        elif required:
            checks.append(Check(name, FAIL, f"not installed (needed for {used_for})", "make setup"))
        else:
            checks.append(Check(name, WARN, f"not installed (only needed for {used_for})",
                                f"pip install {name} if you use it"))
    return checks


def check_accelerate_defaults() -> list[Check]:
    from accelerate.commands.config import default_config_file

    checks = []
    overriding = sorted(k for k in os.environ if k.startswith("ACCELERATE_") and k != "ACCELERATE_LOG_LEVEL")
    if Path(default_config_file).is_file():
        checks.append(Check("accelerate default config", WARN,
                            f"{default_config_file} exists: `accelerate launch` without --config_file uses it",
                            "always pass --config_file accelerate_configs/<strategy>.yaml (the Makefile does), "
                            "or delete the file"))
    else:
        checks.append(Check("accelerate default config", PASS, "none (only our --config_file files apply)"))
    if overriding:
        checks.append(Check("accelerate environment", WARN, "set: " + ", ".join(overriding),
                            "these ACCELERATE_* variables override the config file; unset them"))
    return checks


# ----------------------------------------------------------------------------- system
def expected_checkpoint_gb(recipe_path: str) -> tuple[float, float, str]:
    """Rough GiB of one checkpoint and of the final export, from the recipe's model and LoRA settings."""
    from disttrain.tools import cost

    workload, _ = cost.workload_from_recipe(recipe_path)
    trainable = workload.lora_params or workload.params
    frozen = workload.params - trainable if workload.lora_params else 0
    # trainable: fp32 master weights + two Adam moments (12 B); frozen base weights at their dtype.
    checkpoint = trainable * 12 + frozen * workload.weight_bytes
    export = (workload.lora_params or workload.params) * workload.weight_bytes
    return checkpoint / GIB, export / GIB, f"{checkpoint / GIB:.1f} GiB per checkpoint + {export / GIB:.1f} GiB export"


def check_disk(output_dir: str, recipe: str | None, keep_last: int) -> Check:
    path = Path(output_dir).resolve()
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free / GIB
    if recipe is None:
        status = WARN if free < 50 else PASS
        return Check("disk", status, f"{free:.0f} GiB free at {path}",
                     "a 7B full fine-tune checkpoints ~80 GiB each: free space or set output.dir elsewhere"
                     if status == WARN else "")
    ckpt_gb, export_gb, how = expected_checkpoint_gb(recipe)
    need = ckpt_gb * (keep_last + 1) + export_gb  # keep_last complete ones + the one being written + export
    status = FAIL if free < need else (WARN if free < 2 * need else PASS)
    fix = {FAIL: "free disk space, lower output.keep_last, or point output.dir at a larger volume",
           WARN: "little headroom: a full disk mid-save loses that checkpoint"}.get(status, "")
    return Check("disk", status, f"{free:.1f} GiB free at {path}; need ~{need:.1f} GiB ({how}, keep_last={keep_last})",
                 fix)


def check_shm(gpus: int) -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", WARN, "not present", "NCCL and DataLoader workers need shared memory")
    size = st.f_blocks * st.f_frsize / GIB
    status = PASS if size >= 1 else (FAIL if gpus > 1 else WARN)
    return Check("/dev/shm", status, f"{size:.2f} GiB",
                 "" if status == PASS else "too small (Docker's default is 64 MiB): NCCL fails with 'unhandled system "
                 "error' / bus errors. Run the container with --shm-size=16g or --ipc=host")


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    status = PASS if soft >= 65536 or soft == resource.RLIM_INFINITY else WARN
    return Check("open files", status, f"soft limit {soft}, hard {hard}",
                 "" if status == PASS else "raise it before training (`ulimit -n 65536`): DataLoader workers, NCCL and "
                 "sharded checkpoints open many files ('Too many open files')")


# ----------------------------------------------------------------------------- multi-node
def check_network(nodes: int, node_rank: int, master_addr: str, master_port: int) -> list[Check]:
    import psutil

    from disttrain.runtime import ports

    checks = []
    interfaces = set(psutil.net_if_addrs())
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(var)
        if value:
            names = [n.lstrip("^=") for n in value.split(",") if n]
            known = [n for n in names if any(i.startswith(n) for i in interfaces)]
            status = PASS if known or value.startswith("^") else FAIL
            checks.append(Check(var, status, f"{value} (interfaces here: {', '.join(sorted(interfaces))})",
                                "" if status == PASS else f"no interface matches {value}: set {var} to one listed"))
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"):
        if os.environ.get(var, "0") not in ("", "0"):
            checks.append(Check(var, WARN, f"{var}={os.environ[var]}", "disables a fast path; unset it unless a "
                                "known hardware problem needs it"))
    if nodes <= 1:
        return checks
    loopback = master_addr in ("127.0.0.1", "localhost", "::1")
    checks.append(Check("master address", WARN if loopback else PASS, f"{master_addr}:{master_port}, node {node_rank}"
                        f" of {nodes}", "a loopback address only works when all 'nodes' are this machine: use "
                        "node 0's reachable IP" if loopback else ""))
    if node_rank == 0:
        taken = ports.port_in_use(master_port)
        checks.append(Check("master port", FAIL if taken else PASS,
                            f"{master_port} {'in use' if taken else 'free'} here",
                            ports.conflict_message(master_port) if taken else ""))
    return checks


def wait_reachable(master_addr: str, master_port: int, timeout_s: float) -> Check:
    """From a node other than 0: can we open a TCP connection to node 0's rendezvous port?"""
    from disttrain.runtime import ports

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ports.reachable(master_addr, master_port):
            return Check("master reachable", PASS, f"TCP connect to {master_addr}:{master_port} works")
        time.sleep(1)
    return Check("master reachable", FAIL, f"no TCP connection to {master_addr}:{master_port} within {timeout_s:.0f}s",
                 f"start `make doctor` on node 0 first; otherwise a firewall blocks the port (open {master_port}/tcp "
                 "and NCCL's ephemeral ports between nodes) or MASTER_ADDR is wrong")


# ----------------------------------------------------------------------------- bandwidth
def classify(backend: str, nodes: int, busbw: float) -> tuple[str, str, str]:
    """(class, status, fix) from the peak all_reduce bus bandwidth in GB/s."""
    if backend == "gloo":
        return "CPU processes over TCP (gloo): no GPU interconnect to classify", PASS, ""
    if nodes > 1:
        if busbw >= 20:
            return "InfiniBand / RoCE class between nodes", PASS, ""
        if busbw >= 2:
            return "Ethernet class between nodes", WARN, ("ZeRO-3/FSDP across nodes will be communication-bound: "
                                                          "prefer DDP/ZeRO-1/2 or check that NCCL uses the IB/RoCE "
                                                          "NICs (NCCL_DEBUG=INFO shows NET/IB vs NET/Socket)")
        return "slow network between nodes", WARN, ("NCCL is probably on TCP sockets: "
                                                    "NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME")
    if busbw >= 100:
        return "NVLink / NVSwitch", PASS, ""
    if busbw >= 5:
        return "PCIe", PASS, "fine for DDP/LoRA; FSDP/ZeRO-3 of large models will wait on communication"
    return "slow (GPUs talk through host memory)", WARN, ("check `nvidia-smi topo -m`, NCCL_P2P_DISABLE, IOMMU/ACS; "
                                                          "NCCL_DEBUG=INFO shows the transport")


def run_bandwidth(nproc: int, nodes: int, node_rank: int, master_addr: str, master_port: int,
                  max_bytes: int | None, timeout_s: int) -> tuple[dict | None, str, bool]:
    """Launch the collective benchmark; returns (its JSON on node 0, or None; the launcher's output tail;
    whether every local process exited 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "commbench.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", str(nodes),
               "--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(master_port),
               "-m", "disttrain.tools.commbench", "--out", str(out), "--timeout-s", str(timeout_s)]
        if max_bytes:
            cmd += ["--max-bytes", str(max_bytes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 60, env=env)
        except subprocess.TimeoutExpired:
            return None, f"the bandwidth test did not finish within {timeout_s + 60}s", False
        tail = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode != 0:
            return None, tail, False
        return (json.loads(out.read_text()) if out.exists() else None), tail, True


def bandwidth_checks(bench: dict) -> list[Check]:
    checks = []
    for op in ("all_reduce", "all_gather"):
        rows = [r for r in bench["results"] if r["op"] == op]
        best = max(rows, key=lambda r: r["busbw_gbps"])
        checks.append(Check(f"{op} bandwidth", PASS,
                            f"{bench['backend']} x{bench['world_size']} ranks / {bench['nodes']} node(s): peak busbw "
                            f"{best['busbw_gbps']:.2f} GB/s (algbw {best['algbw_gbps']:.2f}) "
                            f"at {_size(best['bytes'])}"))
    peak = max(r["busbw_gbps"] for r in bench["results"] if r["op"] == "all_reduce")
    label, status, fix = classify(bench["backend"], bench["nodes"], peak)
    checks.append(Check("interconnect", status, label, fix))
    checks.append(compare_versions(bench["versions"]))
    return checks


def compare_versions(versions: list[dict]) -> Check:
    keys = ("torch", "cuda", "nccl", "driver", "python")
    differing = {k: sorted({str(v[k]) for v in versions}) for k in keys if len({str(v[k]) for v in versions}) > 1}
    hosts = sorted({v["host"] for v in versions})
    if differing:
        what = "; ".join(f"{k}: {', '.join(vals)}" for k, vals in differing.items())
        return Check("versions across ranks", FAIL, f"{len(versions)} ranks on {len(hosts)} host(s) differ: {what}",
                     "install the same torch/CUDA/NCCL/driver on every node (mismatched NCCL hangs or fails at "
                     "the first collective)")
    first = versions[0]
    return Check("versions across ranks", PASS, f"{len(versions)} ranks agree: torch {first['torch']}, CUDA "
                 f"{first['cuda']}, NCCL {first['nccl']}, driver {first['driver']}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def bandwidth_table(bench: dict) -> str:
    lines = [f"{'op':<11} {'size':>9} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in bench["results"]:
        lines.append(f"{r['op']:<11} {_size(r['bytes']):>9} {r['time_us']:>10.1f} {r['algbw_gbps']:>11.3f} "
                     f"{r['busbw_gbps']:>11.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- report
def render(checks: list[Check], bench: dict | None) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<26} {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':<6}{'':<26} fix: {c.fix}")
    if bench:
        lines += ["", bandwidth_table(bench)]
    failed = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    lines += ["", f"{len(failed)} FAIL, {len(warned)} WARN, {len(checks) - len(failed) - len(warned)} PASS: " +
              ("fix the FAIL lines before training" if failed else "ready to train")]
    return "\n".join(lines)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="estimate checkpoint size and check its output.dir")
    parser.add_argument("--output-dir", default=None, help="where checkpoints go (default: the recipe's, or outputs/)")
    parser.add_argument("--nproc", type=int, default=None, help="processes per node for the bandwidth test "
                        "(default: GPUs, or 2 on CPU)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 0)) or None)
    parser.add_argument("--max-bytes", type=int, default=None, help="largest message of the bandwidth sweep")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the collective bandwidth test")
    parser.add_argument("--timeout-s", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--torch-build", action="store_true", help="only check that torch's build suits this "
                        "machine (make setup runs it after installing)")
    parser.add_argument("--expect-gpu", action="store_true", help="with --torch-build: a CUDA build is wanted even "
                        "where nvidia-smi lists no GPU (make setup GPU=1, e.g. on a login node)")
    args = parser.parse_args(argv)
    if args.torch_build:
        check = check_torch_build(nvidia_gpus(), args.expect_gpu)
        print(f"setup: {check.detail}" + (f". Fix: {check.fix}" if check.fix else ""),
              file=sys.stderr if check.status == FAIL else sys.stdout)
        return 1 if check.status == FAIL else 0

    output_dir, keep_last = args.output_dir, 2
    if args.recipe:
        from disttrain.recipe.schema import load_recipe
        from disttrain.errors import DisttrainError

        try:
            recipe = load_recipe(args.recipe)
        except DisttrainError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        output_dir, keep_last = output_dir or recipe.output.dir, recipe.output.keep_last
    nproc = args.nproc or default_nproc()
    master_port = args.master_port or (29500 if args.nodes > 1 else free_port())

    checks = check_torch() + check_libraries() + check_accelerate_defaults()
    checks += [check_disk(output_dir or "outputs", args.recipe, keep_last), check_shm(nproc), check_open_files()]
    checks += check_network(args.nodes, args.node_rank, args.master_addr, master_port)
    bench = None
    blocked = any(c.status == FAIL and c.name == "master port" for c in checks)
    if args.nodes > 1 and args.node_rank != 0:
        reach = wait_reachable(args.master_addr, master_port, min(args.timeout_s, 120))
        checks.append(reach)
        blocked = reach.status == FAIL
    if not args.no_bandwidth and not blocked:
        bench, tail, ran = run_bandwidth(nproc, args.nodes, args.node_rank, args.master_addr, master_port,
                                         args.max_bytes, args.timeout_s)
        if bench is not None:
            checks += bandwidth_checks(bench)
        # another node: its processes exiting 0 is the proof (node 0 reports the figures). Their output is not
        # read for "error": a gloo peer that leaves first makes the teardown log one, after the collectives ran
        elif args.node_rank == 0 or not ran:
            checks.append(Check("collective test", FAIL, f"{nproc} x {args.nodes} processes could not all_reduce; "
                                "launcher output: " + " | ".join(tail.strip().splitlines()[-3:]),
                                "run `make diagnose LOG=<that output>`; on several nodes start doctor on all of them"))
        else:
            checks.append(Check("collective test", PASS, "ran; node 0 reports the figures"))

    if args.json:
        print(json.dumps({"ok": not any(c.status == FAIL for c in checks), "checks": [asdict(c) for c in checks],
                          "bandwidth": bench}, indent=1))
    else:
        print(render(checks, bench))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make diagnose LOG=path`: read a failed run's output and name what went wrong, why, and the fix.

    python -m disttrain.tools.diagnose LOG [LOG ...] [--json]

LOG is a log file (any rank's, or the launcher's combined output) or a directory: every *.log / *.out /
*.err / *.txt file in it is read, and a metrics.jsonl (a run's output dir) is checked for loss jumps after a
resume and loss spread across ranks. Findings are ordered: the most likely root cause first, then the
symptoms it explains (a timeout on rank 0 is usually the echo of rank 1 dying first).
Exit status: 0 when something was recognised, 1 when nothing was, 2 when LOG cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disttrain.metrics.log import read_metrics

DOCS = "docs/troubleshooting.md"
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")

# Ordering: root causes (rank 1) before consequences (rank 2) before hints (rank 3).
ROOT, SYMPTOM, HINT = 1, 2, 3


@dataclass
class Rule:
    id: str
    title: str
    level: int
    patterns: list[str]
    cause: str
    fix: str

    def compiled(self) -> list[re.Pattern]:
        return [re.compile(p, re.IGNORECASE | re.MULTILINE) for p in self.patterns]

    def finding(self, where: str, evidence: str, details: dict | None = None) -> Finding:
        return Finding(self.id, self.title, self.level, where, evidence, self.cause, self.fix, details or {})


@dataclass
class Finding:
    id: str
    title: str
    level: int
    where: str
    evidence: str
    cause: str
    fix: str
    details: dict = field(default_factory=dict)

    @property
    def anchor(self) -> str:
        return f"{DOCS}#{self.id.replace('_', '-')}"


RULES = [
    Rule("elastic_shared_store", "Restarted workers could not reconnect (shared rendezvous store)", ROOT,
         [r"after torchrun restarted the workers \(restart (?P<restart>\d+)\): with the shared rendezvous store"],
         "torchrun restarted the workers (--max_restarts) and they kept the agent's rendezvous store of the "
         "failed attempt: a new rank read a dead rank's address and its connect was refused "
         "(pytorch/pytorch#135712; the kill or crash before it was survivable)",
         "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (`make train-<strategy> MAX_RESTARTS=N` sets it); "
         "the job then resumes from its newest checkpoint"),
    Rule("port_in_use", "Rendezvous port already in use", ROOT,
         [r"Tried to launch distributed communication on port `(?P<port>\d+)`, but another process is utilizing it",
          r"The server socket has failed to listen on any local network address.*?port: (?P<port>\d+)",
          r"rendezvous port (?P<port>\d+) is already in use",
          r"EADDRINUSE|Address already in use"],
         "another job (often a previous run that did not exit) listens on the port the launcher wants",
         "stop the old job (`ss -ltnp | grep <port>` names it) or pass another port: make ... MASTER_PORT=29501 "
         "(accelerate launch --main_process_port, torchrun --master_port) on every node"),
    Rule("rendezvous_unreachable", "Could not reach the master node", ROOT,
         [r"The client socket has timed out after (?P<ms>\d+)ms while trying to connect to \((?P<addr>[^,]+), "
          r"(?P<port>\d+)\)",
          r"RendezvousTimeoutError|RendezvousConnectionError"],
         "this node never reached MASTER_ADDR:MASTER_PORT: node 0 is not started, the address is wrong, or a "
         "firewall blocks the port",
         "start node 0 first, use node 0's reachable IP as MASTER_ADDR, open the port (and NCCL's ports) "
         "between nodes; `make doctor NODES=.. NODE_RANK=..` checks reachability"),
    Rule("missing_accelerate_config", "accelerate config file not found", ROOT,
         [r"The passed configuration file `(?P<file>[^`]+)` does not exist"],
         "`accelerate launch --config_file` points at a file that does not exist (paths are relative to the "
         "directory you run from)",
         "run from the repository root, or pass the full path: --config_file accelerate_configs/<strategy>.yaml"),
    Rule("zero3_gather_missing", "ZeRO-3 export without 16-bit gathering", ROOT,
         [r"stage3_gather_16bit_weights_on_model_save`? (?:in DeepSpeed config )?is (?:False|not set)",
          r"stage3_gather_16bit_weights_on_model_save unset or false",
          r"Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save`"],
         "under ZeRO-3 no rank holds the whole model; without stage3_gather_16bit_weights_on_model_save the "
         "final export cannot collect the weights",
         "set \"stage3_gather_16bit_weights_on_model_save\": true in the DeepSpeed JSON (ds_configs/zero3*.json "
         "have it), or recover the weights from a checkpoint with DeepSpeed's zero_to_fp32.py"),
    Rule("duplicate_gpu", "Two ranks on the same GPU", ROOT,
         [r"Duplicate GPU detected : rank (?P<rank_a>\d+) and rank (?P<rank_b>\d+) both on CUDA device (?P<bus>\w+)"],
         "more processes than visible GPUs, a hard-coded torch.cuda.set_device / device='cuda:0', or "
         "CUDA_VISIBLE_DEVICES narrowed to fewer GPUs than --num_processes",
         "make GPUS= (num_processes per node) equal the visible GPUs; never pin a device in code (accelerate "
         "picks cuda:LOCAL_RANK); check CUDA_VISIBLE_DEVICES"),
    Rule("nccl_version_mismatch", "NCCL / CUDA versions differ between ranks", ROOT,
         [r"versions across ranks\s+.*differ",
          r"receiving (?P<got>\d+) bytes instead of (?P<expected>\d+)",
          r"collective mismatch error, local size (?P<got>\d+) remote size (?P<expected>\d+)"],
         "nodes run different torch / NCCL / driver builds (or different code), so the ranks disagree on "
         "the wire format or the sequence of collectives",
         "install the same container or environment on every node; `make doctor` on all nodes compares the "
         "versions of every rank"),
    Rule("device_mismatch", "Tensors on different devices", ROOT,
         [r"Expected all tensors to be on the same device[^\n]*"],
         "a tensor was created on the CPU (or on cuda:0) inside custom code while the model is on this rank's "
         "GPU: a hard-coded .cuda()/.to('cuda:0'), a buffer registered on the CPU, or a batch not moved",
         "let accelerate place things: create tensors with device=accelerator.device (or like an existing "
         "tensor), register buffers in __init__ so .to() moves them, and do not call .to(device) before "
         "accelerator.prepare"),
    Rule("disk_full", "Disk full", ROOT,
         [r"No space left on device|Errno 28|Disk quota exceeded|PytorchStreamWriter failed writing file"],
         "the output volume filled up, typically while writing a checkpoint (each holds weights + optimizer "
         "states, ~12 bytes per trainable parameter)",
         "free space, lower output.keep_last, or set output.dir on a larger volume (`make doctor RECIPE=...` "
         "estimates the space needed); interrupted checkpoints are never resumed from"),
    Rule("cuda_oom", "GPU out of memory", ROOT,
         [r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA|CUBLAS_STATUS_ALLOC_FAILED"],
         "the model states + activations of this rank exceed its GPU memory",
         "lower training.micro_batch_size (raise grad_accum to keep the global batch), turn on "
         "model.gradient_checkpointing, shard more (fsdp / zero3, then *_offload), or shorten data.max_seq_len; "
         "`make cost` shows what fits"),
    Rule("host_oom_or_killed", "A rank was killed (SIGKILL, usually the host OOM killer)", ROOT,
         [r"exitcode\s*:\s*-9\b", r"Signal 9 \(SIGKILL\) received by PID", r"Out of memory: Killed process",
          r"^Killed$"],
         "the operating system killed the process: host RAM ran out (loading a full model on every rank, "
         "dataloader workers, CPU offload) or the scheduler enforced a memory limit",
         "check `dmesg | grep -i oom`; use fsdp/zero3 sharded loading (cpu_ram_efficient_loading), fewer "
         "dataloader workers, or more host RAM for *_offload configs; resume from the last checkpoint"),
    Rule("replica_mismatch", "Replicas diverged", ROOT,
         [r"the weights on ranks \[(?P<ranks>[\d, ]+)\] differ from rank 0's"],
         "ranks that must hold identical weights (DDP, ZeRO-1/2) no longer do",
         "look for code that runs on one rank only between steps (a rank-conditional optimizer step, manual "
         "weight edits, non-synchronised parameters); resume from a checkpoint before the divergence"),
    Rule("native_abort", "A rank aborted in native code", ROOT,
         [r"terminate called without an active exception|terminate called after throwing an instance of"],
         "a C++ thread of the distributed stack ended the process with SIGABRT (exit -6). With torch 2.13 + gloo it "
         "was seen at interpreter exit after a finished run; during training it usually follows a broken "
         "connection (gloo::IoException) to a rank that died",
         "if the run had finished (its final model and metrics are written) nothing is lost: train.py and the "
         "benchmarks skip interpreter teardown to avoid it; otherwise look for the rank that died first"),
    Rule("user_error", "The run stopped on a configuration or data error", ROOT,
         [r"^(?:\[rank\d+\]: )?error: (?!rank \d+ of \d+: )(?P<message>.+)$"],
         "disttrain refused to start or continue; the line names the file/key/step",
         "do what the error line says"),
    Rule("collective_timeout", "Collective timeout / hang", SYMPTOM,
         [r"rank (?P<rank>\d+) of \d+: a collective timed out after (?P<timeout>[\d.]+)s in '(?P<phase>[^']+)' "
          r"at step (?P<step>\d+)",
          r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
          r"[^\n]*?\) ran for (?P<ms>\d+) milliseconds before timing out",
          r"Timed out waiting (?P<ms>\d+)ms for (?P<op>recv|send) operation to complete",
          r"Some NCCL operations have failed or timed out",
          r"no progress for \d+s in '(?P<phase>[^']+)' at step (?P<step>\d+)"],
         "one rank waited longer than the process-group timeout for the others to join a collective: another "
         "rank hung, was stopped, died, or was legitimately slower (tokenising, checkpointing); mismatched "
         "collectives (a rank skipping an all_reduce) end the same way",
         "read the other ranks' output for their first error; if one rank was only busy, raise "
         "distributed.timeout_s; for multi-node hangs check the firewall and NCCL_SOCKET_IFNAME"),
    Rule("rank_died", "Lost connection to a rank that died", SYMPTOM,
         [r"lost the connection to another rank in '(?P<phase>[^']+)' at step (?P<step>\d+)",
          r"could not connect to another rank in '(?P<connect_phase>[^']+)'",
          r"Connection reset by peer|Connection closed by peer|ncclRemoteError|remote process exit|"
          r"connectFullMesh failed"],
         "a peer process exited (crash, OOM kill, preemption) while this rank talked to it",
         "the first failing rank's own error is the real cause; the launcher's 'Root Cause (first observed "
         "failure)' block names it"),
    Rule("missing_accelerate_config", "accelerate launch without a config", HINT,
         [r"The following values were not passed to `accelerate launch` and had defaults used instead"],
         "`accelerate launch` got no --config_file and found no default config: it runs ONE process with no "
         "strategy and no mixed precision, whatever the recipe intends",
         "pass --config_file accelerate_configs/<ddp|fsdp|zero1|zero2|zero3>.yaml, or use the make targets "
         "(make train-ddp ...), which always do"),
    Rule("loss_spread", "Loss differs across ranks", HINT,
         [r"loss differs across ranks by (?P<spread>\d+)%"],
         "ranks see differently distributed data (unshuffled data sharded in blocks, a sampler that is not "
         "distributed) or their weights diverged",
         "keep data.shuffle=true and accelerate's sharded loaders; a replica check (distributed."
         "check_replicas_every) tells whether the weights diverged"),
    Rule("recipe_changed_on_resume", "Resumed with a changed recipe", HINT,
         [r"resuming with a changed recipe: (?P<changes>.+?) \(the checkpoint"],
         "the resumed run trains something else than the saved one (other data or hyper-parameters); a "
         "changed learning rate is silently overridden by the restored optimizer and scheduler states",
         "resume with the saved recipe (output.dir/recipe.yaml); to change the learning rate or data, start a "
         "new run from the exported model instead"),
    Rule("loss_jump_after_resume", "Loss jump after resume", HINT,
         [r"loss jumped after the resume at step (?P<step>\d+)"],
         "the resumed run does not continue the saved one: optimizer or scheduler state not restored, a "
         "changed learning rate / batch / data, or a different data order",
         "resume with the same recipe and process count (disttrain restores weights, optimizer, scheduler, RNG "
         "and data position); compare recipe.yaml of both runs"),
]


_ROOT_CAUSE_BLOCK = re.compile(r"Root Cause \(first observed failure\):\s*\n\[\d+\]:\s*\n(?P<body>(?:\s+\w[^\n]*\n)+)")


def _first_failure(text: str) -> dict | None:
    """torchrun's summary of the first rank that failed: rank, exit code, signal."""
    match = _ROOT_CAUSE_BLOCK.search(text)
    if not match:
        return None
    body = match.group("body")
    info = {}
    for key in ("rank", "exitcode", "host"):
        m = re.search(rf"^\s*{key}\s*:\s*(\S+)", body, re.MULTILINE)
        if m:
            info[key] = m.group(1)
    m = re.search(r"Signal (\d+) \((\w+)\)", body)
    if m:
        info["signal"] = m.group(2)
    return info


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _ranks_of(text: str, rule: re.Pattern) -> set[str]:
    """Ranks on whose lines a pattern occurs ('[rank3]: ...' prefixes or 'GPU 3 has a total capacity')."""
    ranks = set()
    for line in text.splitlines():
        if rule.search(line):
            m = re.match(r"\[rank(\d+)\]", line) or re.search(r"\bGPU (\d+) has a total capacity", line)
            if m:
                ranks.add(m.group(1))
    return ranks


def scan_text(text: str, source: str) -> list[Finding]:
    findings = []
    for rule in RULES:
        for pattern in rule.compiled():
            match = pattern.search(text)
            if not match:
                continue
            details = {k: v for k, v in match.groupdict().items() if v is not None}
            line_end = text.find("\n", match.end())
            evidence = text[match.start():line_end if line_end >= 0 else len(text)].strip()[:300]
            findings.append(rule.finding(f"{source}:{_line_of(text, match.start())}", evidence, details))
            break
    _refine(findings, text)
    return findings


def _refine(findings: list[Finding], text: str) -> None:
    """Add what one pattern cannot see: which rank failed first, OOM on some ranks only, versions in the log."""
    by_id = {f.id: f for f in findings}
    first = _first_failure(text)
    if first:
        for f in findings:
            f.details.setdefault("first_failed_rank", first.get("rank"))
        killed = first.get("signal") == "SIGKILL" or first.get("exitcode", "").startswith("-9")
        if killed and "host_oom_or_killed" not in by_id:
            findings.append(RULES_BY_ID["host_oom_or_killed"].finding(
                "launcher summary", f"rank {first.get('rank')} exitcode {first.get('exitcode')}",
                {"first_failed_rank": first.get("rank")}))
    if "collective_timeout" in by_id:  # ranks that reported a timeout waited for the ones that did not
        reported = re.findall(r"rank (\d+) of (\d+): a collective timed out", text)
        if reported:
            world = int(reported[0][1])
            waiting = sorted({int(r) for r, _ in reported})
            by_id["collective_timeout"].details["ranks_waiting"] = waiting
            by_id["collective_timeout"].details["suspect_ranks"] = [r for r in range(world) if r not in waiting]
    if first and not findings:
        exceptions = re.findall(r"^(?:\[rank\d+\]: )?((?:[\w.]+Error|[\w.]+Exception|SystemExit)\b[^\n]*)$", text,
                                re.MULTILINE)
        errors = [e for e in exceptions if not e.startswith(("torch.distributed.elastic", "ChildFailedError"))]
        findings.append(Finding(
            "rank_failed", f"Rank {first.get('rank')} failed first (exit code {first.get('exitcode')})", ROOT,
            "launcher summary", errors[0][:300] if errors else f"exitcode {first.get('exitcode')}",
            "the first rank to fail is the one to read; the others were stopped by the launcher or lost it",
            "read that rank's traceback (the lines prefixed [rank%s]: or its own log file)" % first.get("rank"),
            {"first_failed_rank": first.get("rank")}))
    if "cuda_oom" in by_id:
        oom = by_id["cuda_oom"]
        ranks = _ranks_of(text, re.compile(RULES_BY_ID["cuda_oom"].patterns[0], re.IGNORECASE))
        world = re.search(r"processes=(\d+)|world_size[=:]\s*(\d+)", text)
        world_size = int(next(g for g in world.groups() if g)) if world else None
        if ranks and world_size and len(ranks) < world_size:
            oom.id, oom.title = "oom_one_rank", f"GPU out of memory on rank(s) {', '.join(sorted(ranks))} only"
            oom.cause = ("memory differs between ranks: the main process does extra work (logging, eval, export "
                         "gathers the full model on rank 0), one rank drew the longest sequences, or another "
                         "process shares that GPU")
            oom.fix = ("check nvidia-smi for other processes on that GPU; keep data.packing or a lower "
                       "data.max_seq_len so batches are even; FSDP/ZeRO-3 export gathers to rank 0 with CPU offload; "
                       "otherwise reduce micro_batch_size for all")
        if ranks:
            oom.details["ranks"] = sorted(ranks)
    versions = sorted(set(re.findall(r"NCCL version (\d+\.\d+\.\d+)", text)))
    if len(versions) > 1 and "nccl_version_mismatch" not in by_id:
        findings.append(RULES_BY_ID["nccl_version_mismatch"].finding(
            "log", f"NCCL versions in this log: {', '.join(versions)}", {"versions": versions}))


RULES_BY_ID = {r.id: r for r in RULES}


# ----------------------------------------------------------------------------- metrics.jsonl
def scan_metrics(path: Path, jump_ratio: float = 1.5) -> list[Finding]:
    """A loss well above the steps before a resume point; per-rank loss spread (from our own metrics)."""
    records = read_metrics(path)
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    findings = []
    for record in records:
        resumed = record.get("resumed_from_step")
        if resumed is None:
            continue
        before = [loss for step, loss in losses if step <= resumed][-5:]
        after = [loss for step, loss in losses if resumed < step <= resumed + 3]
        if before and after and max(after) > jump_ratio * (sum(before) / len(before)):
            findings.append(RULES_BY_ID["loss_jump_after_resume"].finding(
                f"{path} step {resumed + 1}", f"loss jumped after the resume at step {resumed}: "
                f"{sum(before) / len(before):.4g} before, {max(after):.4g} after", {"step": resumed}))
    spread = [r for r in records if r.get("loss_rank_spread", 0) > 0.5]
    if spread:
        worst = max(spread, key=lambda r: r["loss_rank_spread"])
        findings.append(RULES_BY_ID["loss_spread"].finding(
            f"{path} step {worst['step']}",
            f"loss differs across ranks by {worst['loss_rank_spread']:.0%} at step {worst['step']} (rank "
            f"{worst.get('loss_rank_max_rank')}: {worst['loss_rank_max']:.4g}, rank {worst.get('loss_rank_min_rank')}: "
            f"{worst['loss_rank_min']:.4g})", {"steps": len(spread)}))
    return findings


# ----------------------------------------------------------------------------- entry points
def collect(paths: list[Path]) -> tuple[list[tuple[str, str]], list[Path]]:
    logs, metrics = [], []
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and child.suffix in LOG_SUFFIXES:
                    logs.append((str(child), child.read_text(errors="replace")))
                elif child.name == "metrics.jsonl":
                    metrics.append(child)
        elif path.name.endswith(".jsonl"):
            metrics.append(path)
        else:
            logs.append((str(path), path.read_text(errors="replace")))
    return logs, metrics


def diagnose(paths: list[Path]) -> list[Finding]:
    logs, metrics = collect(paths)
    findings = []
    for source, text in logs:
        findings += scan_text(text, source)
    if len(logs) > 1:  # versions printed in different ranks' files
        findings += [f for f in scan_text("\n".join(t for _, t in logs), "all logs")
                     if f.id == "nccl_version_mismatch" and f.evidence.startswith("NCCL versions")]
    for path in metrics:
        findings += scan_metrics(path)
    unique = {}
    for f in sorted(findings, key=lambda f: f.level):
        unique.setdefault(f.id, f)  # first (root-most) occurrence of each class
    return sorted(unique.values(), key=lambda f: f.level)


def render(findings: list[Finding]) -> str:
    if not findings:
        return ("no known failure pattern found. Look for the first 'Traceback' or 'error' of the rank that failed "
                f"first; {DOCS} lists the classes this tool knows.")
    lines = []
    for i, f in enumerate(findings):
        label = "most likely cause" if i == 0 else ("also" if f.level == ROOT else "consequence / hint")
        lines.append(f"[{label}] {f.title}  ({f.id})")
        lines.append(f"  where:    {f.where}")
        lines.append(f"  evidence: {f.evidence}")
        if f.details:
            lines.append("  details:  " + ", ".join(f"{k}={v}" for k, v in f.details.items()))
        lines.append(f"  cause:    {f.cause}")
        lines.append(f"  fix:      {f.fix}")
        lines.append(f"  more:     {f.anchor}")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="log file(s) or directories")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.exists()]
    if missing:
        print(f"error: {', '.join(missing)}: no such file or directory (LOG=path to a log file or an output dir)",
              file=sys.stderr)
        return 2
    findings = diagnose(args.logs)
    if args.json:
        print(json.dumps([{**asdict(f), "docs": f.anchor} for f in findings], indent=1))
    else:
        print(render(findings))
    return 0 if findings else 1


if __name__ == "__main__":
    sys.exit(main())

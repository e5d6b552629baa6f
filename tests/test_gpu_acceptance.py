"""The prepared GPU acceptance run (scripts/gpu/acceptance.py) dry-runs on CPU: the items a CPU can run PASS
on the tiny model, the GPU-only ones are SKIPped with the reason, and an item that fails (here: killed by a
0.3-second --timeout) is recorded with its log tail while the items after it still run. So the first session
with a GPU spends its device minutes checking claims, not debugging the script.

Measured here (2 cores, nothing else running): 75 s for this subset (8 launches: doctor, the forced
failure, full_bf16_single's uninterrupted and resumed runs, lora_ddp, packing_sdpa's isolation and two eval
runs); packing_sdpa's two runs on preference pairs (padded, padding-free) since: 10 launches, 66 s for this file
and test_docs together on 2026-12-07; 30 s in CI the same afternoon once the warm launcher served the harness's
launches (their own datasets cache). CI runs this subset: one full_bf16 item, the others are the same code
under other configs.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.launch

RUN = ["doctor_nccl", "full_bf16_single", "lora_ddp", "packing_sdpa"]
FORCED_FAIL = "full_bf16_fsdp"  # given 0.3 s: its first launch is killed (a warm one takes ~1 s)
GPU_ONLY = ["qlora_fsdp", "adamw_8bit", "packing_flash_attention_2", "fsdp_sync_memory", "mfu"]


def test_acceptance_dry_run_records_every_item(tmp_path):
    out = tmp_path / "out"
    items = [RUN[0], FORCED_FAIL, *RUN[1:], *GPU_ONLY]  # the failure early: the rest must still run
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu/acceptance.py"), "--dry-run", "--out", str(out),
         "--work", str(tmp_path / "work"), "--items", ",".join(items), "--timeout", f"{FORCED_FAIL}=0.3"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: an item FAILed
    result = json.loads((out / "acceptance.json").read_text())
    rows = {r["item"]: r for r in result["items"]}
    assert [r["item"] for r in result["items"]] == items

    for name in RUN:
        assert rows[name]["status"] == "PASS", (rows[name], proc.stdout[-3000:])
    full = rows["full_bf16_single"]["figures"]
    assert full["steps"] == 4 and full["resumed_at"] == 2 and full["max_rel_loss_diff"] <= 1e-5
    packing = rows["packing_sdpa"]["figures"]
    assert packing["isolated"] and packing["eval_rel_diff"] <= 1e-4 and packing["pairs_eval_rel_diff"] <= 1e-4
    assert rows["doctor_nccl"]["figures"]["all_reduce bandwidth"].startswith("PASS")

    failed = rows[FORCED_FAIL]
    assert failed["status"] == "FAIL" and "timed out" in failed["detail"], failed
    assert "(killed after" in failed["log_tail"]

    for name in GPU_ONLY:
        assert rows[name]["status"] == "SKIP" and rows[name]["detail"] == "needs a GPU (dry run on CPU)", rows[name]

    md = (out / "acceptance.md").read_text()
    assert "4 PASS, 1 FAIL, 5 SKIP, 0 INFO" in md
    assert f"| {FORCED_FAIL} | FAIL |" in md and f"## {FORCED_FAIL}: FAIL" in md
    log = (out / "launches.log").read_text()
    for label in ("doctor_nccl / doctor", f"{FORCED_FAIL} / uninterrupted", "full_bf16_single / resumed",
                  "lora_ddp / run", "packing_sdpa / isolation", "packing_sdpa / unpacked"):
        assert f"===== {label} (exit" in log, label
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.json", "acceptance.md", "launches.log"]

    import torch

    if not torch.cuda.is_available():  # without --dry-run the script needs a GPU: one line, exit 2
        bare = subprocess.run([sys.executable, str(REPO / "scripts/gpu/acceptance.py"), "--out", str(tmp_path / "x")],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bare.returncode == 2 and bare.stderr.strip().startswith("error: no CUDA GPU visible"), bare.stderr

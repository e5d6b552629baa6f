"""Installing the GPU kit's wheels on the GPU machine (`make gpu-kit` builds them: scripts/gpu/kit.py): with
--no-deps into site-packages or a target dir on PYTHONPATH, then every version range --no-deps skipped is
checked, one line each."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kit  # stdlib + packaging: the kit's parts and the version pins its install skipped
from harness import MAX_LOG_TAIL


def installed_versions() -> dict[str, str]:
    return {(d.metadata["Name"] or "?").lower(): d.version for d in importlib.metadata.distributions()}


def install_wheels(folder: Path, target: Path | None = None) -> dict:
    """pip install --no-deps the kit's wheels (make gpu-kit): into site-packages when it is writable, else into
    `target` (default: a temp dir), which then goes first on sys.path and on PYTHONPATH for every launch."""
    import sysconfig

    wheels = sorted(folder.glob("*.whl"))
    record = {"dir": str(folder), "wheels": [w.name for w in wheels]}
    if not wheels:
        record.update(ok=False, error=f"no .whl files in {folder}")
        return record
    if target is None and not os.access(sysconfig.get_paths()["purelib"], os.W_OK):
        target = Path(tempfile.gettempdir()) / "disttrain_site"
    before = installed_versions()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--find-links", str(folder), *(["--upgrade", "--target", str(target)] if target else []),
           *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if target is not None:
        record["target"] = str(target)
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    after = installed_versions()
    record.update(ok=proc.returncode == 0, exit=proc.returncode,
                  installed={k: v for k, v in after.items() if before.get(k) != v})
    if proc.returncode != 0:
        record["error"] = (proc.stdout + proc.stderr)[-MAX_LOG_TAIL:]
        return record
    # --no-deps skipped every version range: check them here, before the first item (one line each)
    manifest = folder / "manifest.json"
    names = ([p["name"] for p in json.loads(manifest.read_text())["parts"]] if manifest.is_file()
             else [w.name.split("-")[0] for w in wheels])
    record["pins"] = kit.pin_mismatches(names, kit.project_requirements())
    return record


def wheels_line(record: dict) -> str:
    if record["ok"]:
        where = f" into {record['target']}" if record.get("target") else ""
        pins = (f"; {len(record['pins'])} version pin(s) not met: " + "; ".join(record["pins"])
                if record.get("pins") else "; every version pin met")
        return ("installed " + (", ".join(f"{k} {v}" for k, v in record["installed"].items()) or "nothing new")
                + where + pins)
    return "FAILED: " + record["error"][-300:]


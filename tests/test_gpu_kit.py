"""`make gpu-kit` (scripts/gpu/kit.py): the list of what the GPU machine lacks is complete, the pure-Python
parts install into a target dir and import from there, and the version check acceptance.py runs after its
--no-deps install names each range that is not met. The binary downloads themselves are not made here."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "gpu"))
import kit  # noqa: E402


def test_the_manifest_pins_what_ci_tests_and_nothing_is_missing(monkeypatch):
    rows = kit.manifest()
    names = [r["name"] for r in rows]
    assert {"pydantic", "pydantic-core", "datasets", "deepspeed", "bitsandbytes"} <= set(names)
    assert len(names) == len(set(names))  # one version each: two would stop the install
    for row in rows:
        assert row["version"] == __import__("importlib.metadata").metadata.version(row["name"])
    assert kit.missing_requirements(rows) == []
    # the check can fail: without hjson (and pydantic's core) the kit is incomplete, and says which
    incomplete = [r for r in rows if r["name"] not in ("hjson", "pydantic-core")]
    missing = kit.missing_requirements(incomplete)
    assert any(line.startswith("deepspeed ") and "needs hjson" in line for line in missing), missing
    assert any(line.startswith("pydantic ") and "needs pydantic-core==" in line for line in missing), missing
    # every requirement that is not carried is in the GPU image (markers evaluated for python 3.12 on Linux)
    monkeypatch.setattr(kit, "DEVICE_HAS", kit.DEVICE_HAS - {"pyarrow"})
    assert any("datasets" in line and "pyarrow" in line for line in kit.missing_requirements(rows))


def test_check_only_lists_the_kit_without_downloading():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/kit.py"), "--check-only"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "build  deepspeed==" in proc.stdout and "slim   bitsandbytes==" in proc.stdout


def test_pin_mismatches_are_one_line_each():
    assert kit.pin_mismatches(["datasets", "pydantic"], kit.project_requirements()) == []
    lines = kit.pin_mismatches(["pydantic"], ["pyarrow>=999", "no-such-package-xyz>=1"])
    have = __import__("importlib.metadata").metadata.version("pyarrow")
    assert lines == [f"disttrain needs pyarrow>=999, this machine has pyarrow {have}",
                     "disttrain needs no-such-package-xyz>=1, which is not installed"]
    assert kit.pin_mismatches(["not-installed-dist"]) == [
        "not-installed-dist is not installed (the kit carries it: was it installed?)"]


@pytest.mark.network
def test_the_pure_python_parts_install_into_a_target_and_import_from_it(tmp_path, monkeypatch):
    """What acceptance.py does on the GPU machine when site-packages is not writable, for the carried
    pure-Python wheels (downloaded from the registry for this interpreter; the binaries are not fetched)."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pure = [r for r in kit.manifest() if r["kind"] == "pure"]
    spec = [f"{r['name']}=={r['version']}" for r in pure]
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "-d", str(wheels), *spec], capture_output=True, text=True, timeout=300)
    assert download.returncode == 0, download.stderr[-2000:]
    assert len(list(wheels.glob("*.whl"))) == len(pure)
    from kit_install import install_wheels

    monkeypatch.setattr(sys, "path", list(sys.path))  # install_wheels puts the target first on both
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    record = install_wheels(wheels, target)
    assert record["ok"] and record["target"] == str(target), record
    assert record["pins"] == [], record["pins"]  # the versions CI tests meet every range
    modules = {"pydantic": "pydantic", "annotated-types": "annotated_types", "typing-inspection":
               "typing_inspection", "typing-extensions": "typing_extensions", "datasets": "datasets",
               "dill": "dill", "multiprocess": "multiprocess", "hjson": "hjson", "trl": "trl",
               # lm-evaluation-harness and what it needs (the eval_during_training item)
               "lm_eval": "lm_eval", "evaluate": "evaluate", "more-itertools": "more_itertools",
               "pytablewriter": "pytablewriter", "DataProperty": "dataproperty", "mbstrdecoder": "mbstrdecoder",
               "pathvalidate": "pathvalidate", "tabledata": "tabledata", "tcolorpy": "tcolorpy", "typepy": "typepy",
               "chardet": "chardet", "nltk": "nltk", "defusedxml": "defusedxml", "sacrebleu": "sacrebleu"}
    assert {r["name"] for r in pure} == set(modules)
    probe = ("import importlib, json, sys; print(json.dumps({m: importlib.import_module(m).__file__ "
             f"for m in {sorted(modules.values())!r}}}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(target)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = json.loads(proc.stdout)
    assert all(path.startswith(str(target)) for path in files.values()), files

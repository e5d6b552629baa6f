"""Start-up cost cuts that must not change what runs (disttrain/runtime/startup.py)."""

import gc
import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO
from disttrain.runtime import startup


def test_the_collector_is_paused_then_running_again():
    assert gc.isenabled()
    startup.pause_collector()
    try:
        assert not gc.isenabled()
    finally:
        startup.resume_collector()
    assert gc.isenabled()


@pytest.mark.parametrize("report_to, visible", [(["none"], False), (["tensorboard", "wandb"], False),
                                                (["mlflow"], True), (["tensorboard", "mlflow"], True)])
def test_mlflow_is_hidden_unless_the_recipe_logs_to_it(report_to, visible, monkeypatch):
    pytest.importorskip("mlflow")  # installed with the test extras: hiding it must make it look absent
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)  # restored after the test
    startup.hide_unused_trackers(report_to)
    assert (importlib.util.find_spec("mlflow") is not None) is visible
    if not visible:
        with pytest.raises(ImportError):
            import mlflow  # noqa: F401
        from accelerate.utils import is_mlflow_available

        assert not is_mlflow_available()


@pytest.mark.heavy
def test_deepspeed_imports_without_mlflow_when_it_is_hidden():
    """The point of hiding it: `import deepspeed` (which otherwise imports mlflow when installed) leaves it
    out, and still imports."""
    probe = ("import sys; from disttrain.runtime import startup; {hide}import deepspeed; "
             "print(type(sys.modules.get('mlflow')).__name__)")
    seen = {}
    for hide in ("", "startup.hide_unused_trackers(['none']); "):
        proc = subprocess.run([sys.executable, "-c", probe.format(hide=hide)], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[bool(hide)] = proc.stdout.strip().splitlines()[-1]
    assert seen == {False: "module", True: "NoneType"}

"""The start-up cost cut must not change what runs (disttrain/runtime/startup.py); what it saves is measured
in docs/benchmarks.md, "Start-up"."""

import gc
from disttrain.runtime import startup


def test_the_collector_is_paused_then_running_again():
    assert gc.isenabled()
    startup.pause_collector()
    try:
        assert not gc.isenabled()
    finally:
        startup.resume_collector()
    assert gc.isenabled()



def test_train_py_pauses_the_collector_before_its_heavy_imports():
    """Importing train.py (what `accelerate launch train.py` runs first) leaves the collector paused, with torch
    imported after the pause (guards imports it); train.main resumes it before the loop."""
    import subprocess
    import sys

    from conftest import REPO

    probe = "import gc, sys; import train; print(gc.isenabled(), 'torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"]
    source = (REPO / "train.py").read_text()
    assert source.index("startup.pause_collector()") < source.index("import guards")
    assert source.index("startup.resume_collector()") < source.index("loop.train(")

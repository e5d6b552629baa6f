"""The start-up cost cut must not change what runs (disttrain/runtime/startup.py); what it saves is measured
in docs/benchmarks.md, "Start-up"."""

import gc

import pytest

from disttrain.runtime import startup


def test_the_collector_is_paused_then_running_again():
    assert gc.isenabled()
    startup.pause_collector()
    try:
        assert not gc.isenabled()
    finally:
        startup.resume_collector()
    assert gc.isenabled()


@pytest.mark.parametrize("allocated_mib, says", [((10, 2), True), ((10, 9.5), False), ((4, 4), False)])
def test_on_a_gpu_the_pass_says_how_much_gpu_memory_set_up_left_in_cycles(allocated_mib, says, monkeypatch, capsys):
    """The signal the GPU acceptance run reads (scripts/gpu/items/finetune.py): one line when the pass that
    ends the pause frees >= 1 MiB of GPU memory, none otherwise (torch.cuda's counters faked on this CPU)."""
    import torch

    readings = iter(int(mib * 2**20) for mib in allocated_mib)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: next(readings))
    startup.pause_collector()
    startup.resume_collector()
    assert gc.isenabled()
    err = capsys.readouterr().err
    assert (startup.CYCLES_HELD_GPU_MEMORY in err) is says, err
    if says:
        assert "8 MiB of GPU memory" in err


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


def test_what_exists_when_the_imports_are_frozen_stays_and_what_set_up_makes_after_is_collected():
    """freeze_imports: a cycle dropped before it is out of the collector's sight (the imports' few), one dropped
    after it is freed by the pass that ends set-up; train.py freezes once the process group exists, before the
    tokenizer, the data and the model."""
    import weakref

    from conftest import REPO

    class Node:
        pass

    def dropped_cycle():
        node = Node()
        node.me = node
        return weakref.ref(node)

    was_enabled = gc.isenabled()
    gc.disable()
    old = dropped_cycle()
    startup.freeze_imports()
    new = dropped_cycle()
    try:
        gc.collect()
        assert new() is None and old() is not None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    source = (REPO / "train.py").read_text()
    assert source.index("build_accelerator(recipe)") < source.index("startup.freeze_imports()") < \
        source.index("loading.load_tokenizer(") < source.index("startup.resume_collector()")

"""data.streaming: each rank reads its own shards lazily; a stopped run resumes exactly where it was, without
replaying the stream (the position is in the checkpoint), under DDP, FSDP2 and ZeRO-3."""

import json

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, held_out, launch, write_recipe
from disttrain.training import checkpoint
from disttrain.recipe.schema import DataSection, load_recipe
from disttrain.data import Collator, StreamLoader, streaming, stream_rows
from disttrain.errors import DataError, RecipeError
from disttrain.metrics.log import read_metrics

FILES = 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 files of 60 alpaca records each, every record naming its file and row."""
    folder = tmp_path_factory.mktemp("shards")
    for f in range(FILES):
        with (folder / f"part-{f}.jsonl").open("w") as out:
            for r in range(60):
                out.write(json.dumps({"instruction": f"Repeat file {f} row {r}.", "output": f"river {r} stone"}) + "\n")
    return folder


def section(shards, **kw):
    return DataSection(**{"path": str(shards / "part-*.jsonl"), "format": "alpaca", "max_seq_len": 64,
                          "streaming": True, **kw})


def loader(sec, tokenizer, rank=0, world=2, batch=2):
    return StreamLoader(stream_rows(sec, tokenizer, 0, rank, world), batch, Collator(tokenizer.pad_token_id),
                        torch.device("cpu"))


def take(it, n):
    return [next(it)["input_ids"] for _ in range(n)]


@pytest.mark.parametrize("packing, world", [(False, 2), (True, 2), (False, 3)])  # 3: one record in 3 per rank
def test_resume_is_exact_across_passes(shards, tokenizer, packing, world):
    """Stopped anywhere (inside the first pass, or in the second), a new loader given the saved state yields
    exactly what the uninterrupted one yields next; the state survives JSON (it goes into checkpoints)."""
    sec = section(shards, packing=packing)
    reference = loader(sec, tokenizer, world=world)
    full = take(iter(reference), 90)
    assert reference.passes >= 1, "the test must cross into a second pass over the rank's shards"
    for stop in (7, 70):
        first = loader(sec, tokenizer, world=world)
        head = take(iter(first), stop)
        resumed = loader(sec, tokenizer, world=world)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        tail = take(iter(resumed), 90 - stop)
        assert all(torch.equal(a, b) for a, b in zip(full, head + tail)), f"stopped after {stop} batches"


def test_resume_does_not_replay_the_stream(shards, tokenizer, monkeypatch):
    """Resuming late re-tokenises no more records than resuming early: only the batches in progress."""
    monkeypatch.setattr(streaming, "MAP_BATCH", 8)
    monkeypatch.setattr(streaming, "ROWS_BATCH", 8)
    tokenised = []
    real = streaming.tokenize_batch
    monkeypatch.setattr(streaming, "tokenize_batch", lambda records, *a, **k: (tokenised.append(len(records)),
                                                                               real(records, *a, **k))[1])
    sec = section(shards, packing=True)
    costs = {}
    for stop in (3, 20, 45, 80, 130):
        first = loader(sec, tokenizer, batch=1)
        take(iter(first), stop)
        resumed = loader(sec, tokenizer, batch=1)
        resumed.load_state_dict(first.state_dict())
        tokenised.clear()
        take(iter(resumed), 1)
        costs[stop] = sum(tokenised)
    # each stage (tokenise, filter, pack) restarts at the start of its batch in progress: a few batches of 8
    # records whatever the position, while 130 packed rows hold about 400 records
    assert max(costs.values()) <= 4 * 8, costs


def test_ranks_read_disjoint_shards(shards, tokenizer):
    """4 files, 2 ranks: each rank's first pass holds only its own two files, together all of them."""
    seen = {}
    for rank in (0, 1):
        rows = stream_rows(section(shards, shuffle=False), tokenizer, 0, rank, 2)
        text = [tokenizer.decode(r["input_ids"]) for r in rows]
        seen[rank] = {t.split("file ")[1].split(" ")[0] for t in text}
        assert len(text) == 2 * 60
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == {str(f) for f in range(FILES)}
    assert streaming.shards_note(section(shards), 3)  # 4 shards for 3 ranks: every rank reads all, says so
    assert not streaming.shards_note(section(shards), 2)


def test_bad_record_in_a_stream_is_named_by_file_and_line(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'output'"):
        take(iter(loader(section(tmp_path, path=str(bad)), tokenizer, world=1)), 1)


def test_streaming_needs_max_steps_and_a_matching_checkpoint(tmp_path):
    with pytest.raises(RecipeError, match="data.streaming: true needs training.max_steps"):
        load_recipe(REPO / "recipes/tiny/sft.yaml", ["data.streaming=true"])
    saved = checkpoint.RunShape(2, "ddp", 2, 2, streaming=True)
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": 4, "shape": saved.__dict__}))
    with pytest.raises(checkpoint.CheckpointError, match="same number of processes"):
        checkpoint.check_shape(ckpt, checkpoint.RunShape(4, "ddp", 1, 2, streaming=True))
    with pytest.raises(checkpoint.CheckpointError, match="data.streaming=True"):
        checkpoint.check_shape(ckpt, checkpoint.RunShape(2, "ddp", 2, 2, streaming=False))


STEPS, SAVED = 12, 4


@pytest.mark.launch
@pytest.mark.parametrize("strategy", ["single_gpu", "ddp", "fsdp", "zero3"])
def test_a_streaming_run_resumes_like_uninterrupted(strategy, tmp_path, tiny_model_dir, shards):
    """Packed stream over 4 shards, 2 ranks (`make train`: one), grad_accum 2, crossing a pass; a new process given
    the step-4 checkpoint reads each rank's saved stream position and repeats the uninterrupted run's losses from
    step 5 on, evaluations included."""
    processes = 1 if strategy == "single_gpu" else 2
    def recipe(name):
        return write_recipe(tmp_path / f"{name}.yaml", base_recipe(
            tiny_model_dir, tmp_path / name,
            data={"path": str(shards / "part-*.jsonl"), "streaming": True, "packing": True,
                  "eval_path": str(held_out(tmp_path))},
            training={"max_steps": STEPS, "micro_batch_size": 2, "eval_every": 4},
            output={"checkpoint_every": SAVED, "keep_last": 3, "save_final_model": False}))

    assert_ok(launch(strategy, recipe("a"), nproc=processes))
    saved = tmp_path / "a" / "checkpoints" / f"step-{SAVED:08d}"
    assert sorted(p.name for p in (saved / checkpoint.DATA_STATE).iterdir()) == [
        f"rank-{rank:05d}.json" for rank in range(processes)]
    second = launch(strategy, recipe("b"), nproc=processes, overrides=[f"output.resume={saved}"])
    assert_ok(second)
    assert f"resumed from {saved} at step {SAVED}/{STEPS}" in second.stdout
    a_lines, b_lines = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert len({r["step"] for r in a_lines if "loss" in r}) == STEPS
    for key in ("loss", "eval_loss"):
        a_vals = {r["step"]: r[key] for r in a_lines if key in r and r["step"] > SAVED}
        b_vals = {r["step"]: r[key] for r in b_lines if key in r}
        assert sorted(b_vals) == sorted(a_vals) and b_vals == pytest.approx(a_vals, rel=1e-6, abs=1e-7), key


def test_ranks_that_cannot_split_files_tokenise_only_their_own_records(shards, tokenizer, monkeypatch):
    """4 files for 3 ranks: each rank reads everything but tokenises one record in 3 (before the fix every rank
    tokenised and packed the whole stream and kept one packed row in 3); together the ranks cover every record
    once. In a mixture each source is split its own way, and the note names exactly the one that cannot be."""
    tokenised = []
    real = streaming.tokenize_batch
    monkeypatch.setattr(streaming, "tokenize_batch", lambda records, *a, **k: (tokenised.append(len(records)),
                                                                               real(records, *a, **k))[1])
    seen = []
    for rank in range(3):
        tokenised.clear()
        rows = list(stream_rows(section(shards, shuffle=False), tokenizer, 0, rank, 3))
        assert sum(tokenised) == len(rows) == FILES * 60 // 3
        seen += [tokenizer.decode(r["input_ids"]) for r in rows]
    assert len(seen) == len(set(seen)) == FILES * 60
    single = shards.parent / "single.jsonl"
    single.write_text("".join(json.dumps({"instruction": f"Say single {r}.", "output": "stone"}) + "\n"
                              for r in range(30)))
    mixture = DataSection(sources=[{"path": str(shards / "part-*.jsonl"), "format": "alpaca", "name": "files"},
                                   {"path": str(single), "format": "alpaca", "name": "single"}],
                          max_seq_len=64, streaming=True, shuffle=False)
    notes = streaming.shards_note(mixture, 2)
    assert len(notes) == 1 and "streaming single: 1 shard(s) for 2 ranks" in notes[0]
    texts = {rank: [tokenizer.decode(r["input_ids"]) for r in stream_rows(mixture, tokenizer, 0, rank, 2)]
             for rank in (0, 1)}
    files = {rank: {t.split("file ")[1].split(" ")[0] for t in texts[rank] if "file " in t} for rank in (0, 1)}
    singles = {rank: {t for t in texts[rank] if "single" in t} for rank in (0, 1)}
    assert files[0].isdisjoint(files[1]) and len(files[0]) == len(files[1]) == 2  # own files
    assert singles[0] and singles[1] and singles[0].isdisjoint(singles[1])  # one record in two each

"""Records in: a local file (checked record by record, errors named file:line) or a `datasets` hub name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from disttrain.config import SourceSection, looks_local
from disttrain.data.formats import to_example
from disttrain.errors import DataError


def check_record(record, where: str, source: SourceSection) -> None:
    """One clear line for a record this source's format cannot read."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    try:
        to_example(record, source)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _records(path: Path):
    """(where, record) of a .jsonl file, or of a .json file holding one list."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        yield from ((f"{path}: record {i}", rec) for i, rec in enumerate(records))
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        yield f"{path}:{lineno}", record


def validate_local_file(path: str, source: SourceSection) -> int:
    """Scan a local file so a bad record is reported as file:line before any tokenising. Returns #records
    (-1 for parquet: columnar files are checked during tokenisation, where the record index is named)."""
    p = Path(path)
    if p.suffix == ".parquet":
        return -1
    count = 0
    for where, record in _records(p):
        check_record(record, where, source)
        count += 1
    return count


def load_split(path: str, split: str, source: SourceSection):
    """A `datasets.Dataset` from a local file (validated first) or a hub dataset name."""
    import datasets

    if looks_local(path):
        if validate_local_file(path, source) == 0:
            raise DataError(f"{path}: the file holds no records")
        builder = "parquet" if path.endswith(".parquet") else "json"
        return datasets.load_dataset(builder, data_files={"train": path}, split="train")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as exc:  # hub unreachable, unknown name, bad split: say which and why
        raise DataError(f"data source {path!r} (split {split!r}): could not load from the hub or cache: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

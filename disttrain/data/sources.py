"""Records in: local files (a path or a glob) or a `datasets` hub name.

Local files are read by `datasets` (Arrow, memory-mapped cache) without a separate validation pass: a record
the format cannot read is found during tokenisation, and only then is the file scanned, line by line (memory
independent of the file size), to name the first bad record as file:line. The happy path reads each file once.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping
from pathlib import Path

from disttrain.recipe.schema import SourceSection, looks_local
from disttrain.data.formats import to_example
from disttrain.errors import DataError


def check_record(record, where: str, source: SourceSection, check=None) -> None:
    """One clear line for a record this source's format (or `check`, e.g. the chat template) cannot take."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    try:
        (check or (lambda r: to_example(r, source)))(record)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _is_json_list(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return path.suffix == ".json" and head.startswith("[")


def _records(path: Path):
    """(where, record) of a .jsonl file, read line by line, or of a .json file holding one list (read whole:
    use .jsonl for large data)."""
    if _is_json_list(path):
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        yield from ((f"{path}: record {i}", rec) for i, rec in enumerate(records))
        return
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            yield f"{path}:{lineno}", record


def local_files(path: str) -> list[str]:
    """The files of a local path: the file itself, or every file a glob (`data/part-*.jsonl`) matches."""
    if glob.has_magic(path):
        files = sorted(glob.glob(path))
        if not files:
            raise DataError(f"{path}: the pattern matches no file")
        return files
    return [path]


def validate_local_file(path: str, source: SourceSection, check=None) -> int:
    """Scan local file(s) record by record (constant memory) and raise at the first record the format (or
    `check`) cannot take, named file:line. Returns the number of records (-1 for parquet: columnar files name the row
    index during tokenisation instead)."""
    count = 0
    for file in local_files(path):
        p = Path(file)
        if p.suffix == ".parquet":
            return -1
        for where, record in _records(p):
            check_record(record, where, source, check)
            count += 1
    return count


def builder_of(path: str) -> str:
    return "parquet" if path.endswith(".parquet") else "json"


def load_split(path: str, split: str, source: SourceSection):
    """A `datasets.Dataset` from local file(s) or a hub dataset name."""
    import datasets

    if looks_local(path):
        try:
            dataset = datasets.load_dataset(builder_of(path), data_files={"train": local_files(path)}, split="train")
        except DataError:
            raise
        except Exception as exc:  # malformed JSON, mixed column types: name the record if the scan finds it
            if validate_local_file(path, source) == 0:
                raise DataError(f"{path}: the file holds no records") from None
            raise DataError(f"{path}: datasets could not read it: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        if len(dataset) == 0:
            raise DataError(f"{path}: the file holds no records")
        return dataset
    try:
        return datasets.load_dataset(path, source.subset, split=split)
    except Exception as exc:  # hub unreachable, unknown name, bad split: say which and why
        subset = f", subset {source.subset!r}" if source.subset else ""
        raise DataError(f"data source {path!r} (split {split!r}{subset}): could not load from the hub or cache: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

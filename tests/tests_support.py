"""Small helpers shared by tests (not fixtures)."""

import json

from conftest import REPO


def alpaca_rows(n: int) -> list[dict]:
    lines = (REPO / "data/tiny_alpaca.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]

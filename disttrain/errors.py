"""User-facing errors: each becomes one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import sys
from contextlib import contextmanager


class DisttrainError(Exception):
    """A mistake the user can fix (bad recipe, bad data line, missing file). Message = the whole story."""

    exit_code = 2


class RecipeError(DisttrainError):
    pass


class DataError(DisttrainError):
    pass


@contextmanager
def exit_on_user_error():
    """Turn a DisttrainError into `error: <message>` on stderr and exit code 2."""
    try:
        yield
    except DisttrainError as exc:
        from tqdm import tqdm

        tqdm.write(f"error: {exc}", file=sys.stderr)  # on its own line, even under a progress bar
        sys.stderr.flush()
        sys.exit(exc.exit_code)

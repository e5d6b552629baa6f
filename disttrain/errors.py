"""User-facing errors: each becomes one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
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
        if _in_a_launched_process_group():  # skip the interpreter's teardown, as a finished train.py does: with
            sys.stdout.flush()              # the process group alive a C++ thread of the distributed stack can
            os._exit(exc.exit_code)         # abort the rank there (SIGABRT), and the launcher reports that instead
        sys.exit(exc.exit_code)


def _in_a_launched_process_group() -> bool:
    """A rank of a multi-process launch with its process group made (never an in-process test or tool)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()

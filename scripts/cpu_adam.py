"""DeepSpeed's CPU Adam, compiled ahead of its first use (`make setup`).

The offload configs (zero3_offload.yaml, ZeRO-2 offload) step the optimizer with DeepSpeed's CPU Adam, a C++
extension DeepSpeed compiles with torch's JIT builder the first time a process asks for it (~90 CPU-s here), and
again whenever the environment's headers are newer than its build (a fresh virtual environment). A first offload
run would stall that long on it. `make setup` installs DeepSpeed first and compiles it here while pip installs the
rest (pip's downloads and unpacking leave a core idle), into the cache the first run reads (torch's extensions
directory): that run then only checks the build. Run by path: the project is not installed yet.

    python scripts/cpu_adam.py --spec test   # DeepSpeed's requirement in those extras (pyproject.toml), or nothing
    python scripts/cpu_adam.py --build       # compile it (a no-op when the build is current)
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def deepspeed_requirement(extras: str) -> str:
    """The first DeepSpeed requirement of the named extras (comma-separated), '' when none asks for it."""
    optional = tomllib.loads(PYPROJECT.read_text())["project"].get("optional-dependencies", {})
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        for requirement in optional.get(extra, []):
            if re.match(r"deepspeed\b", requirement):
                return requirement
    return ""


def build() -> int:
    """Compile it as DeepSpeedCPUAdam loads it (deepspeed/ops/adam/cpu_adam.py), so that the build lands where that
    load looks; DeepSpeed missing or the op not buildable here: nothing to do (the first use says why)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as exc:
        print(f"cpu_adam: DeepSpeed not importable ({exc}); nothing compiled")
        return 0
    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        print("cpu_adam: not compatible with this machine; nothing compiled")
        return 0
    builder.load(verbose=False)
    print("cpu_adam: compiled")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--spec", metavar="EXTRAS", help="print DeepSpeed's requirement in these extras")
    group.add_argument("--build", action="store_true", help="compile DeepSpeed's CPU Adam")
    args = parser.parse_args(argv)
    if args.spec is not None:
        print(deepspeed_requirement(args.spec))
        return 0
    return build()


if __name__ == "__main__":
    sys.exit(main())

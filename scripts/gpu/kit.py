"""The GPU kit: everything the lent GPU machine lacks for `scripts/gpu/acceptance.py`, in one folder to carry.

    make gpu-kit                      # -> gpu_kit/ (wheels + manifest.json), and the command to run there
    python3 scripts/gpu/kit.py --check-only   # the manifest and its completeness, no downloads

The GPU machine (python 3.12, torch, transformers, accelerate, peft, no registry) has no pydantic, datasets,
deepspeed or bitsandbytes. The kit carries, at the versions installed here (the versions CI tests):
- pure-Python wheels as published (pydantic, datasets, hjson, ...);
- cp312 manylinux wheels of the compiled ones (pydantic-core, bitsandbytes);
- DeepSpeed, which PyPI has only as a source archive, built here into a pure-Python wheel with no prebuilt
  ops (DS_BUILD_OPS=0: its ops compile just in time on the GPU machine, where nvcc is);
- bitsandbytes slimmed to the one CUDA library the machine's torch loads (the full wheel holds one per
  CUDA version, ~43 MB), plus the CPU library it always loads.
Everything fits the 64 MiB that may travel. `manifest.json` lists each wheel with its kind and sha256.

Completeness is checked without a GPU: every requirement of every carried package (markers evaluated for
python 3.12 on Linux) must be another carried package or one the GPU image already has (DEVICE_HAS below,
from the device notes). `--no-deps` installs skip version ranges, so acceptance.py checks them on the
machine itself before its first item (`pin_mismatches`) and says each mismatch in one line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 64 * 2**20  # what may travel to the GPU machine, working tree included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


@dataclass(frozen=True)
class Part:
    name: str   # distribution name as pip knows it
    kind: str   # pure: a py3 wheel as published; binary: a cp312 manylinux wheel; build: built here; slim
    why: str


KIT = [
    Part("pydantic", "pure", "disttrain's recipe schema (every item)"),
    Part("pydantic-core", "binary", "pydantic's compiled core"),
    Part("annotated-types", "pure", "pydantic"),
    Part("typing-inspection", "pure", "pydantic"),
    Part("typing-extensions", "pure", "pydantic needs a newer one than many images have"),
    Part("datasets", "pure", "disttrain's data pipeline (every item)"),
    Part("dill", "pure", "datasets"),
    Part("multiprocess", "pure", "datasets"),
    Part("deepspeed", "build", "ZeRO items (a source archive on PyPI: built here, ops compile just in time)"),
    Part("hjson", "pure", "deepspeed"),
    Part("bitsandbytes", "slim", "QLoRA and adamw_8bit items"),
    Part("torchao", "binary", "fp8_vs_bf16 item: torchao's float8 layers (training.mixed_precision: fp8)"),
    Part("trl", "pure", "loss_memory item: TRL's fused LM head (training.loss_impl: trl) beside the chunked loss"),
    Part("lm_eval", "pure", "eval_during_training item: lm-evaluation-harness (evaluation: section, make eval)"),
    Part("evaluate", "pure", "lm_eval"),
    Part("more-itertools", "pure", "lm_eval"),
    Part("pytablewriter", "pure", "lm_eval"),
    Part("DataProperty", "pure", "pytablewriter"),
    Part("mbstrdecoder", "pure", "pytablewriter"),
    Part("pathvalidate", "pure", "pytablewriter"),
    Part("tabledata", "pure", "pytablewriter"),
    Part("tcolorpy", "pure", "pytablewriter"),
    Part("typepy", "pure", "pytablewriter"),
    Part("chardet", "pure", "mbstrdecoder"),
    Part("rouge-score", "build", "lm_eval (a source archive on PyPI: built here, pure Python)"),
    Part("nltk", "pure", "rouge-score"),
    Part("defusedxml", "pure", "nltk"),
    Part("sacrebleu", "pure", "lm_eval"),
    Part("sqlitedict", "build", "lm_eval (a source archive on PyPI: built here)"),
    Part("word2number", "build", "lm_eval (a source archive on PyPI: built here)"),
]

# The GPU image's Python packages (device notes, read 2026-11-17): carried packages need nothing else.
DEVICE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest python-dateutil pytorch-lightning pyyaml
regex requests rich safetensors scikit-learn scipy seaborn sentencepiece setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server threadpoolctl tiktoken timm
tokenizers toolz torch torchaudio torchvision tqdm transformers triton typer typing-inspect urllib3 wheel wrapt
xarray xxhash yarl zipp
""".split())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def manifest() -> list[dict]:
    """The kit's parts at the versions installed here (one version each: two would stop the install)."""
    rows = []
    for part in KIT:
        try:
            version = importlib.metadata.version(part.name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"error: {part.name} is not installed here; run `make setup` first (the kit carries "
                             "the versions CI tests)") from None
        rows.append({**asdict(part), "version": version})
    return rows


def requirements_of(name: str, version: str | None = None) -> list:
    """Requirements of an installed distribution that apply on the GPU machine (python 3.12, Linux, no extras)."""
    from packaging.requirements import Requirement

    dist = importlib.metadata.distribution(name)
    if version is not None and dist.version != version:
        raise SystemExit(f"error: {name} {dist.version} is installed, the kit names {version}")
    found = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET_ENV):
            found.append(req)
    return found


def missing_requirements(rows: list[dict]) -> list[str]:
    """Requirements that neither the kit nor the GPU image provides: must be empty."""
    carried = {canonical(r["name"]) for r in rows}
    missing = []
    for row in rows:
        for req in requirements_of(row["name"], row["version"]):
            if canonical(req.name) not in carried | DEVICE_HAS:
                missing.append(f"{row['name']} {row['version']} needs {req}")
    return missing


def pin_mismatches(names: list[str], extra: list[str] = ()) -> list[str]:
    """On the machine the kit was installed on: every version range of the named distributions' requirements
    (and the `extra` requirement strings, e.g. disttrain's own) that the installed versions do not meet.
    One line each; an absent requirement is a mismatch too."""
    from packaging.requirements import Requirement

    def check(owner: str, req) -> str | None:
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return f"{owner} needs {req}, which is not installed"
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            return f"{owner} needs {req}, this machine has {req.name} {have}"
        return None

    lines = []
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} is not installed (the kit carries it: was it installed?)")
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate():
                lines.append(check(f"{name} {dist.version}", req))
    for text in extra:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate():
            lines.append(check("disttrain", req))
    return [line for line in lines if line]


def project_requirements() -> list[str]:
    """disttrain's own dependency ranges (pyproject.toml): the GPU machine runs it from the repo, uninstalled."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


# ----------------------------------------------------------------------------- building the folder
def pip(*args: str, env: dict | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise SystemExit(f"error: pip {' '.join(args[:3])} ... failed: {' | '.join(tail)}")


def fetch(row: dict, folder: Path) -> None:
    spec = f"{row['name']}=={row['version']}"
    if row["kind"] == "build":  # a wheel of the source archive, no compiled ops in it
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder), spec, env={"DS_BUILD_OPS": "0"})
    elif row["kind"] == "pure":  # py3 or py312 tags (multiprocess publishes one wheel per python)
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "-d", str(folder), spec)
    else:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
            "cp", *platforms, "-d", str(folder), spec)


def slim_bitsandbytes(wheel: Path, cuda: str) -> tuple[int, int]:
    """Keep only libbitsandbytes_cpu and libbitsandbytes_cuda<cuda> (and drop them from RECORD)."""
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda})\.")
    dropped = 0
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        libraries = [i.filename for i in src.infolist()
                     if re.search(r"libbitsandbytes_\w+\.(so|dylib|dll)$", i.filename)]
        if not any(keep.search(name) and "cuda" in name for name in libraries):
            raise SystemExit(f"error: {wheel.name} has no libbitsandbytes_cuda{cuda}; it has: "
                             + ", ".join(sorted(Path(n).name for n in libraries)))
        removed = {name for name in libraries if not keep.search(name)}
        for info in src.infolist():
            if info.filename in removed:
                dropped += 1
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if line.split(",")[0] not in removed]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    slim.replace(wheel)
    return before, wheel.stat().st_size


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, cuda: str) -> list[dict]:
    rows = manifest()
    missing = missing_requirements(rows)
    if missing:
        raise SystemExit("error: the kit is incomplete: " + "; ".join(missing))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    for row in rows:
        with tempfile.TemporaryDirectory() as tmp:
            fetch(row, Path(tmp))
            (wheel,) = Path(tmp).glob("*.whl")
            if row["kind"] == "slim":
                before, after = slim_bitsandbytes(wheel, cuda)
                row["slimmed"] = f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB (cpu + cuda{cuda})"
            wheel.replace(out / wheel.name)
        row.update(file=wheel.name, bytes=(out / wheel.name).stat().st_size, sha256=sha256(out / wheel.name))
        print(f"  {row['kind']:<6} {wheel.name}  {row['bytes'] / 2**20:.1f} MiB", flush=True)
    total = sum(r["bytes"] for r in rows)
    (out / "manifest.json").write_text(json.dumps({"python": "3.12", "cuda": cuda, "bytes": total, "parts": rows},
                                                  indent=1))
    if total > LIMIT_BYTES:
        raise SystemExit(f"error: the kit is {total / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB that may travel")
    return rows


def device_command(folder: str) -> str:
    return f"python3 scripts/gpu/acceptance.py --out $OUT --wheels {folder}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu_kit", help="the folder to carry (default gpu_kit/)")
    parser.add_argument("--cuda", default="130", help="CUDA version of the GPU machine's torch, as bitsandbytes "
                        "names its libraries (130 = CUDA 13.0, torch 2.11 there)")
    parser.add_argument("--check-only", action="store_true", help="print the manifest and check it, no downloads")
    args = parser.parse_args(argv)
    if args.check_only:
        rows = manifest()
        for row in rows:
            print(f"  {row['kind']:<6} {row['name']}=={row['version']}  ({row['why']})")
        missing = missing_requirements(rows)
        for line in missing:
            print(f"error: not carried and not on the GPU image: {line}", file=sys.stderr)
        return 1 if missing else 0
    rows = build(args.out, args.cuda)
    total = sum(r["bytes"] for r in rows)
    try:
        shown = args.out.resolve().relative_to(REPO)
    except ValueError:
        shown = args.out
    print(f"gpu kit: {len(rows)} wheels, {total / 2**20:.1f} MiB in {shown}/ (manifest.json lists them)")
    print(f"on the GPU machine, from the repo root, carrying {shown}:\n    {device_command(str(shown))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Install what ``make gpu-check`` needs beside a CUDA build of torch (``make gpu-deps``).

Mooncake ships one wheel per CUDA major version, exclusive with the CPU wheel this
project's ``pyproject.toml`` pins (``mooncake-transfer-engine-non-cuda``): CUDA 12 is
``mooncake-transfer-engine``, CUDA 13 ``mooncake-transfer-engine-cuda13``, each at the
version the CPU wheel is pinned to (``mooncake.reshard``'s API moves between releases:
0.3.14 has no ``StoredFragment``). This picks the one matching the CUDA build of the torch
that runs it, and installs it with the few pure Python packages the update path imports,
into ``--target`` (put it on ``PYTHONPATH``), so the machine's own torch and CUDA stay
untouched. ``--wheels DIR`` installs offline from wheels carried there (a machine that
reaches no package index); ``--download DIR`` fills such a folder on a machine that does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

MOONCAKE = {
    "12": "mooncake-transfer-engine==0.3.13.post1",
    "13": "mooncake-transfer-engine-cuda13==0.3.13.post1",
}
#: Parts of Mooncake's CUDA wheels the update path never loads: the torch process-group
#: backend (``pg_*.so`` and its 160 MB library), the expert-parallel kernels and the
#: Transfer Engine's benchmark binary. Without them the CUDA 13 wheel is 34 MB, not 98 MB,
#: which is what lets it travel to an offline GPU machine beside the project.
UNUSED_PARTS = (
    "mooncake/libmooncake_pg.so",
    "mooncake/libmooncake_pg_device.so",
    "mooncake/pg_2_",
    "mooncake/_ep.cpython-",
    "mooncake/libmooncake_ep_device.so",
    "mooncake/transfer_engine_bench",
)
#: manylinux tags pip must be told by name when it downloads for another machine.
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in (17, 27, 28, 31, 34, 35)))
RUNTIME = (
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "xxhash==4.1.0",
    "orjson==3.13.0",
)


def mooncake_wheel(cuda: str | None) -> str:
    """The Mooncake wheel for torch's CUDA version (``torch.version.cuda``)."""
    if not cuda:
        raise SystemExit(
            "gpu-deps: this torch has no CUDA build (torch.version.cuda is None); run it with "
            "the Python whose torch is the CUDA one (make gpu-check GPU_PY=/path/to/python3)"
        )
    major = cuda.split(".")[0]
    if major not in MOONCAKE:
        raise SystemExit(
            f"gpu-deps: no Mooncake wheel for CUDA {cuda}; Mooncake ships CUDA "
            f"{' and '.join(sorted(MOONCAKE))} wheels"
        )
    return MOONCAKE[major]


def pip_command(cuda: str | None, target: Path, wheels: Path | None) -> list[str]:
    source = ["--no-index", "--find-links", str(wheels)] if wheels else []
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--upgrade",
        "--target",
        str(target),
        *source,
        mooncake_wheel(cuda),
        *RUNTIME,
    ]


def download_command(directory: Path, cuda: str, python: str) -> list[str]:
    """``pip download`` of every wheel ``pip_command`` installs, for another machine."""
    platforms = [f"--platform={tag}" for tag in PLATFORMS]
    return [
        *(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"),
        *("--implementation", "cp", "--python-version", python, *platforms),
        *("--dest", str(directory), mooncake_wheel(cuda), *RUNTIME),
    ]


def slim_wheel(wheel: Path) -> int:
    """Rewrite ``wheel`` without ``UNUSED_PARTS`` (files and RECORD lines); bytes saved.
    Entries keep their zip attributes, so executables (``mooncake_master``) stay so."""
    unused = tuple(part.encode() for part in UNUSED_PARTS)
    before = wheel.stat().st_size
    slim = wheel.with_name(wheel.name + ".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w") as target:
        for entry in source.infolist():
            if entry.filename.startswith(UNUSED_PARTS):
                continue
            data = source.read(entry)
            if entry.filename.endswith(".dist-info/RECORD"):
                lines = data.splitlines(keepends=True)
                data = b"".join(line for line in lines if not line.startswith(unused))
            target.writestr(entry, data)
    slim.replace(wheel)
    return before - wheel.stat().st_size


def download(directory: Path, cuda: str, python: str) -> int:
    command = download_command(directory, cuda, python)  # refuses an unknown CUDA first
    directory.mkdir(parents=True, exist_ok=True)
    status = subprocess.run(command, check=False).returncode
    if status == 0:
        name = mooncake_wheel(cuda).split("==")[0].replace("-", "_")
        for wheel in directory.glob(f"{name}-*.whl"):
            print(f"{wheel.name}: {slim_wheel(wheel) >> 20} MiB of unused parts dropped")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_env", description=__doc__)
    parser.add_argument("--target", type=Path, help="install into this folder")
    parser.add_argument("--wheels", type=Path, help="install offline from the wheels here")
    parser.add_argument("--download", type=Path, help="download the wheels into this folder")
    parser.add_argument("--cuda", default="13.0", help="with --download: the GPU's CUDA")
    parser.add_argument("--python", default="3.12", help="with --download: the GPU's Python")
    args = parser.parse_args(argv)
    if args.download:
        return download(args.download, args.cuda, args.python)
    if args.target is None:
        parser.error("--target (install) or --download (fetch wheels) is required")
    import torch

    wheels = args.wheels if args.wheels and args.wheels.is_dir() else None
    command = pip_command(torch.version.cuda, args.target, wheels)
    print(" ".join(command[3:]), file=sys.stderr)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())

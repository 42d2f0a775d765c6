"""Install what ``make gpu-check`` needs beside a CUDA build of torch (``make gpu-deps``).

Mooncake ships one wheel per CUDA major version, exclusive with the CPU wheel this
project's ``pyproject.toml`` pins (``mooncake-transfer-engine-non-cuda``): CUDA 12 is
``mooncake-transfer-engine``, CUDA 13 ``mooncake-transfer-engine-cuda13``. This picks the
one matching the CUDA build of the torch that runs it, and installs it with the few pure
Python packages the update path imports, into ``--target`` (put it on ``PYTHONPATH``), so
the machine's own torch and CUDA stay untouched. ``--wheels DIR`` installs offline from
wheels carried there (a machine that reaches no package index).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

MOONCAKE = {
    "12": "mooncake-transfer-engine==0.3.13.post1",
    "13": "mooncake-transfer-engine-cuda13==0.3.14",
}
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


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.gpu_env", description=__doc__)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--wheels", type=Path, help="install offline from the wheels here")
    args = parser.parse_args(argv)
    wheels = args.wheels if args.wheels and args.wheels.is_dir() else None
    command = pip_command(torch.version.cuda, args.target, wheels)
    print(" ".join(command[3:]), file=sys.stderr)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())

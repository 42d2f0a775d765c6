"""SGLang test setup, only where SGLang is installed (``.venv-sglang``).

The tests' out-of-tree model package must be named before SGLang builds its model registry,
and nothing outside this machine is reachable, so the Hugging Face hub stays offline.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("sglang") is not None:
    os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "tests.sglang.models")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

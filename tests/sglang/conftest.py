"""SGLang test setup: the tests' out-of-tree model package, set before SGLang reads it."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "tests.sglang.models")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing outside this machine is reachable

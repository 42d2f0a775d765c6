"""Hypothesis strategies for the ``/mooncake/*`` routes: valid bodies and hostile mutations.

A case is a short sequence of calls. Each body starts from a valid template (so that
sessions open and calls reach the workers) and is then kept, or has one field replaced by
an arbitrary JSON value, dropped, joined by an unknown field, or is replaced whole by
arbitrary JSON or bytes. Two session ids are shared by every case, so rival sessions meet.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

SESSIONS = ("a" * 32, "b" * 32)
MUTABLE = ("drain", "renew", "prepare", "apply", "commit", "abort", "adapter")
ROUTES = (*MUTABLE, "rebuild", "status", "placement", "ready")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def templates(model: str, generation: int, session: str, digest: str) -> dict[str, dict[str, Any]]:
    """A well-formed body per route (valid as far as the route's types can tell)."""
    region = {"base": 4096, "size": 4096}
    peer = {"worker_id": "w0", "node": "n", "endpoint": "127.0.0.1:1", "regions": {"r": region}}
    row = {"name": "t", "region": "r", "offset": 0, "shape": [4], "dtype": "float32"}
    routing = {
        "slice": {
            "names": ["r", f"{model}/g{generation}/x"],
            "regions": [[0, 16]],
            "stages": [[{"reads": [[1, 0, 0, 0, 16]], "pushes": []}]],
        },
        "layout": [row],
        "fallback": [],
    }
    return {
        "drain": {"session": session, "holder": "fuzz", "ttl_s": 600, "mode": "abort"},
        "renew": {"session": session},
        "prepare": {
            "session": session,
            "model": model,
            "generation": generation,
            "manifest_digest": digest,
            "mode": "compat",
            "stages": 1,
            "workers": {"w0": routing},
        },
        "apply": {"session": session, "generation": generation, "stage": 0, "peers": {"w0": peer}},
        "commit": {"session": session, "generation": generation},
        "abort": {"session": session},
        "adapter": {"generation": generation},
    }


@st.composite
def body_for(draw: st.DrawFn, template: dict[str, Any]) -> bytes:
    kind = draw(st.sampled_from(("valid", "replace", "drop", "extra", "json", "bytes")))
    body: Any = dict(template)
    if kind == "replace":
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
    elif kind == "extra":
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in body))] = draw(
            json_values
        )
    elif kind == "json":
        body = draw(json_values)
    elif kind == "bytes":
        return draw(st.binary(max_size=64))
    return json.dumps(body).encode()


@st.composite
def calls(
    draw: st.DrawFn, model: str, generation: int, digest: str
) -> list[tuple[str, str, bytes]]:
    """A case: (method, route, body) calls, mostly on the update routes."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        route = draw(st.sampled_from(ROUTES))
        if route not in MUTABLE:
            steps.append(
                ("GET" if route in ("status", "placement", "ready") else "POST", route, b"")
            )
            continue
        session = draw(st.sampled_from(SESSIONS))
        template = templates(
            model, draw(st.sampled_from((generation, generation + 1))), session, digest
        )
        steps.append(("POST", route, draw(body_for(template[route]))))
    return steps

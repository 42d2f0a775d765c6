"""What an engine serves: the active record it loaded or committed, and its weight version.

A loader or a commit tags the live model with a :class:`ServedRecord`; the receiver starts
from it, refuses requests it is not superseded by, and tags every output token with its
:func:`weight_version`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_rl.protocol import PrepareRequest, UpdateTarget


@dataclass(frozen=True)
class ServedRecord:
    """Which active record an engine serves: generation, fence and Store incarnation.

    Within one incarnation the fence orders records (``activate`` may name an older
    generation under a newer fence); across incarnations nothing compares, since a master
    that lost its state restarts its numbering.
    """

    generation: int = 0
    fence: int = 0
    incarnation: str | None = None

    def superseded_by(self, request: UpdateTarget | PrepareRequest) -> bool:
        if request.incarnation is not None and self.incarnation not in (None, request.incarnation):
            return True
        if request.fence and self.fence:
            return request.fence > self.fence
        return request.generation > self.generation


def weight_version(model: str, served: ServedRecord) -> str:
    """``name:incarnation:generation``: the weight version every output token is tagged
    with (vLLM's ``weight_versions`` spans, SGLang's equivalent)."""
    return f"{model}:{served.incarnation or '-'}:{served.generation}"

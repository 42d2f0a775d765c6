"""Proof that every staged byte a commit lands was written in its session.

The landing check compares the live model with a reference built *from staging*, so it
proves the landing, not the staging: a plan that declares every region but reads nothing
would land whatever the arena held (the previous generation, or zeros) and pass. Hashing
staging against the generation's checksums is not possible in general: those cover 4 MiB
blocks of the published objects, and a TP shard holds parts of many blocks (a column shard
holds strided rows of each).

So prepare fills every arena region with a canary word derived from the session and the
generation, and the check refuses to land any region in which a word still holds it. Every
staged byte must then have been overwritten during the session, by a read of the
generation's objects (``engine_ext.admission.check_reads``: whole objects of that
generation, checked against their checksums where a read covers whole blocks) or by a push
from a peer's staging, which was filled with the same canary, so a push of bytes the peer
never read is caught too. A legitimate word equals the 64-bit canary with probability
2**-64 (a false refusal, never a false pass).

Not covered: parameters received in place (live bytes cannot be overwritten while the
engine serves); bytes a plan reads into the wrong offsets, or pushes from a peer's live
parameters. Costs one fill and one compare pass over the staged bytes per update
(``docs/performance.md``, checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

WORD = 8


def session_canary(session: str, generation: int) -> int:
    """The canary word of one session's update, the same on every worker of it."""
    return xxhash.xxh3_64_intdigest(f"{session}/{generation}".encode()) - (1 << 63)


def _parts(span: torch.Tensor, canary: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A contiguous span as its bytes up to the first 8-byte aligned address, its aligned
    words, and its tail, beside the canary bytes each part holds when unwritten (the fill
    is aligned to addresses, so any sub-span of a filled region compares alike)."""
    flat = span.reshape(-1).view(torch.uint8)
    head = min(-flat.data_ptr() % WORD, flat.numel())
    whole = (flat.numel() - head) // WORD * WORD
    pattern = torch.tensor([canary], dtype=torch.int64).view(torch.uint8).to(flat.device)
    phase = torch.arange(flat.data_ptr(), flat.data_ptr() + head, device=flat.device) % WORD
    tail = flat[head + whole :]
    return (
        torch.stack([flat[:head], pattern[phase]]),
        flat[head : head + whole].view(torch.int64)
        if whole
        else torch.empty(0, dtype=torch.int64, device=flat.device),
        torch.stack([tail, pattern[: tail.numel()]]),
    )


def fill_canary(regions: Iterable[torch.Tensor], canary: int) -> None:
    """Overwrite every region (contiguous) with the canary word."""
    for region in regions:
        head, words, tail = _parts(region, canary)
        flat = region.reshape(-1).view(torch.uint8)
        flat[: head.shape[1]].copy_(head[1])
        words.fill_(canary)
        flat[flat.numel() - tail.shape[1] :].copy_(tail[1])


def unwritten(spans: Mapping[str, torch.Tensor], canary: int) -> list[str]:
    """Names of the spans (views of filled regions) in which an aligned word, or an
    unaligned head or tail, still holds the canary, in name order. A head or tail of ``t``
    bytes matches by chance with probability 2**-(8t): spans start and end at row bounds,
    8-byte aligned in practice, and a false refusal is retried by the next session."""
    found = []
    for name in sorted(spans):
        head, words, tail = _parts(spans[name], canary)
        if (
            bool((words == canary).any())
            or (head.shape[1] and torch.equal(head[0], head[1]))
            or (tail.shape[1] and torch.equal(tail[0], tail[1]))
        ):
            found.append(name)
    return found

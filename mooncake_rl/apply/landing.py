"""Staged bytes into live parameters: copy lists planned once, each landing a few native calls.

A MoE rank lands tens of thousands of small tensors; building lists, looking names up or
calling ``copy_`` per tensor in Python costs more than the bytes (DESIGN: 65,536 tensors
scattered at 2.5 GB/s in a Python loop). :meth:`Landing.of` does that work once, when the
pairs are known (a worker's prepare); :meth:`Landing.run` is then one
``torch._foreach_copy_`` per group of same-device, same-word pairs: on CUDA one fused
multi-tensor kernel per group, on the CPU split over torch's intra-op threads (a
single-tensor copy is single-threaded below torch's grain size, so a CPU list copy would
otherwise use one core where a plain copy uses all).

Pairs are copied as raw bytes, viewed as the widest integer word their sizes and addresses
allow: integer words are bit-exact for any dtype (fp8, bf16 NaN payloads) and a CUDA
multi-tensor copy moves 8 bytes per element instead of 1. Pairs adjacent in memory on both
sides (parameters carved one after another from one allocation, staged in the same order)
are copied as one: a CPU copies many small pieces at one thread's memory speed (5,000 pieces
of 6 KB: 4.5 GB/s), one large piece at all threads' (15 GB/s, ``docs/performance.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mooncake_rl.apply.verify import device_span, host_bytes

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CopyGroup:
    """Targets and sources on one device, viewed as one integer word: one native list copy."""

    targets: tuple[torch.Tensor, ...]
    sources: tuple[torch.Tensor, ...]
    nbytes: int


@dataclass(frozen=True)
class Landing:
    """Every (target, source) pair of one landing, grouped and split once."""

    groups: tuple[CopyGroup, ...]
    tensors: int
    nbytes: int
    runs: int
    """Copies after merging pairs adjacent on both sides."""
    pairs: tuple[Pair, ...] = ()
    """The pairs as given: merged pairs are views of raw addresses, which keep nothing
    alive, so the landing holds the tensors whose memory they cover."""

    @classmethod
    def of(cls, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Landing:
        """Plan a landing of each source's bytes into its target (same dtype and shape, both
        dense, same device). Raises before anything is copied if a pair cannot land."""
        grouped: dict[tuple[torch.device, torch.dtype | None], list[Pair]] = {}
        given = list(pairs)
        for target, source in given:
            _word(target, source)  # refuse any pair that cannot land, before merging
        merged = _adjacent_merged(given)
        for target, source in merged:
            word = _word(target, source)
            # A CPU list copy loops over its pairs whatever their words; CUDA fuses only a
            # list of one dtype into one kernel.
            key = (target.device, None if target.device.type == "cpu" else word)
            grouped.setdefault(key, []).append((_flat(target, word), _flat(source, word)))
        groups: list[CopyGroup] = []
        for (device, _), found in grouped.items():
            groups.extend(_split(found, torch.get_num_threads() if device.type == "cpu" else 1))
        nbytes = sum(g.nbytes for g in groups)
        return cls(tuple(groups), len(given), nbytes, len(merged), tuple(given))

    def run(self) -> None:
        """Copy every pair (asynchronous on CUDA: the caller synchronizes)."""
        on_cpu = [g for g in self.groups if g.targets[0].device.type == "cpu"]
        for group in self.groups:
            if group.targets[0].device.type != "cpu":
                _copy(group)
        if not on_cpu:
            return
        helpers = [_threads(len(on_cpu) - 1).submit(_copy, g) for g in on_cpu[1:]]
        _copy(on_cpu[0])
        for helper in helpers:
            helper.result()


def _word(target: torch.Tensor, source: torch.Tensor) -> torch.dtype:
    """The widest integer word both tensors' sizes and addresses are multiples of."""
    if (target.dtype, target.shape) != (source.dtype, source.shape):
        raise ValueError(
            f"cannot land a {source.dtype} {tuple(source.shape)} tensor into a "
            f"{target.dtype} {tuple(target.shape)} one"
        )
    nbytes = target.nbytes
    if target.device != source.device:
        raise ValueError(f"cannot land bytes from {source.device} into {target.device}")
    if not (target.is_contiguous() and source.is_contiguous()):
        raise ValueError("landing copies dense bytes: target and source must be contiguous")
    for word in WORDS:
        size = word.itemsize
        if nbytes % size == 0 and target.data_ptr() % size == 0 == source.data_ptr() % size:
            return word
    raise AssertionError("a byte is always a word")


def _adjacent_merged(pairs: list[Pair]) -> list[Pair]:
    """``pairs``, with each run adjacent in memory on both sides (by target address, one
    device) as one pair of byte views over the run; pairs alone as given."""
    order = sorted(pairs, key=lambda p: (str(p[0].device), p[0].data_ptr()))
    out: list[Pair] = []
    run: list[Pair] = []
    for pair in order:
        if run and not _follows(run[-1], pair):
            out.append(_joined(run))
            run = []
        run.append(pair)
    if run:
        out.append(_joined(run))
    return out


def _follows(before: Pair, after: Pair) -> bool:
    (t0, s0), (t1, s1) = before, after
    return (
        t0.device == t1.device
        and t0.data_ptr() + t0.nbytes == t1.data_ptr()
        and s0.data_ptr() + s0.nbytes == s1.data_ptr()
    )


def _joined(run: list[Pair]) -> Pair:
    if len(run) == 1:
        return run[0]
    nbytes = sum(t.nbytes for t, _ in run)
    device = str(run[0][0].device)
    return (
        _bytes_at(run[0][0].data_ptr(), nbytes, device),
        _bytes_at(run[0][1].data_ptr(), nbytes, device),
    )


def _bytes_at(address: int, nbytes: int, device: str) -> torch.Tensor:
    """``nbytes`` of memory at ``address`` as a uint8 tensor sharing it."""
    if device == "cpu":
        return torch.frombuffer(host_bytes(address, nbytes), dtype=torch.uint8)
    return device_span(address, nbytes, device)


def _flat(tensor: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """A 1-D view in ``word``s (a parameter's view needs no autograd: copies run in
    inference mode)."""
    return tensor.view(-1).view(word)


def _split(pairs: list[Pair], parts: int) -> list[CopyGroup]:
    """``pairs`` in at most ``parts`` consecutive groups of about equal bytes."""
    total = max(1, sum(t.nbytes for t, _ in pairs))
    groups: list[CopyGroup] = []
    start, done = 0, 0
    for index, (target, _) in enumerate(pairs):
        done += target.nbytes
        if done * parts >= total * (len(groups) + 1) or index == len(pairs) - 1:
            chunk = pairs[start : index + 1]
            groups.append(
                CopyGroup(
                    tuple(t for t, _ in chunk),
                    tuple(s for _, s in chunk),
                    sum(t.nbytes for t, _ in chunk),
                )
            )
            start = index + 1
    return groups


def _copy(group: CopyGroup) -> None:
    with torch.inference_mode():  # thread-local; skips autograd's work on every tensor
        torch._foreach_copy_(group.targets, group.sources)


@functools.cache
def _threads(count: int) -> ThreadPoolExecutor:
    """Helpers beside the calling thread, kept: a landing is too short to start threads."""
    return ThreadPoolExecutor(count, thread_name_prefix="mooncake-rl-land")

"""Landing staged bytes into parameters: every target gets exactly its source's bytes."""

from __future__ import annotations

import pytest
import torch

from mooncake_rl.apply.landing import Landing
from mooncake_rl.apply.process import WorkerMemory, _parameters, _Received
from mooncake_rl.plan.demand import STAGING_REGION

DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.bool, torch.int64)


def random_bytes(nbytes: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_target_gets_exactly_its_sources_bytes(threads: int) -> None:
    """Mixed dtypes and odd sizes, sources at arena offsets aligned only to their dtype
    (few fit a wide word), targets both separate
    allocations and views between guard bytes: each target holds its own source's bytes
    (random, so bf16/fp8 NaN payloads too), and no byte beside a target changes."""
    generator = torch.Generator().manual_seed(7)
    shapes = [(3,), (5, 7), (64, 33), (1,), (128, 256), (2, 3, 5), (4096,), (11, 13)]
    dtypes = [DTYPES[i % len(DTYPES)] for i in range(len(shapes))]
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    arena = random_bytes(sum(sizes) + 16 * len(sizes), generator)
    before_arena = raw(arena)
    shared = random_bytes(sum(sizes) + 64 * len(sizes), generator)
    guards = raw(shared)
    pairs, offset, cursor = [], 0, 0
    for index, (shape, dtype, nbytes) in enumerate(zip(shapes, dtypes, sizes, strict=True)):
        offset = -(-offset // dtype.itemsize) * dtype.itemsize + dtype.itemsize
        source = arena[offset : offset + nbytes].view(dtype).view(shape)
        offset += nbytes
        if index % 2:
            target = torch.zeros(shape, dtype=dtype)
        else:  # a view inside one buffer, 64 guard bytes before it
            cursor += 64
            target = shared[cursor : cursor + nbytes].view(dtype).view(shape)
            cursor += nbytes
        pairs.append((target, source))

    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        landing = Landing.of(pairs)
    finally:
        torch.set_num_threads(kept)
    assert (landing.tensors, landing.nbytes) == (len(pairs), sum(sizes))
    assert 1 <= len(landing.groups) <= threads
    landing.run()

    for target, source in pairs:
        assert raw(target) == raw(source)
    assert raw(arena) == before_arena
    cursor, landed = 0, bytearray(guards)
    for index, nbytes in enumerate(sizes):
        if index % 2 == 0:
            cursor += 64
            landed[cursor : cursor + nbytes] = raw(pairs[index][1])
            cursor += nbytes
    assert raw(shared) == bytes(landed)


def test_a_parameter_lands_in_place_and_keeps_requiring_grad() -> None:
    parameter = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16))
    storage = parameter.data_ptr()
    source = torch.randn(8, 16).to(torch.bfloat16)
    Landing.of([(parameter, source)]).run()
    assert torch.equal(parameter.data, source) and parameter.data_ptr() == storage
    assert parameter.requires_grad


def test_a_landing_is_planned_once_and_lands_each_run_again() -> None:
    target, source = torch.zeros(256, dtype=torch.int32), torch.arange(256, dtype=torch.int32)
    landing = Landing.of([(target, source)])
    landing.run()
    assert torch.equal(target, source)
    source.add_(1)
    landing.run()
    assert torch.equal(target, torch.arange(1, 257, dtype=torch.int32))


@pytest.mark.parametrize(
    ("target", "source", "problem"),
    [
        (
            torch.zeros(4),
            torch.zeros(8),
            r"torch.float32 \(8,\) tensor into a torch.float32 \(4,\)",
        ),
        (torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16), "bfloat16"),
        (torch.zeros(4, 4).t(), torch.zeros(4, 4), "contiguous"),
    ],
    ids=["wrong-size", "wrong-dtype", "strided"],
)
def test_a_pair_that_cannot_land_is_refused_before_any_copy(
    target: torch.Tensor, source: torch.Tensor, problem: str
) -> None:
    good_target, good_source = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match=problem):
        Landing.of([(good_target, good_source), (target, source)])
    assert torch.equal(good_target, torch.zeros(4))


def test_pairs_adjacent_on_both_sides_land_as_one_copy_and_others_as_given() -> None:
    """Parameters carved back to back from one slab, staged back to back in the same order,
    land in one copy; a pair whose source sits elsewhere stays its own. Every target gets
    exactly its source's bytes and the slab's other bytes stay."""
    generator = torch.Generator().manual_seed(3)
    sizes = [6144, 2048, 4096, 1024]
    slab = random_bytes(sum(sizes) + 1024, generator)
    arena = random_bytes(sum(sizes) + 512, generator)
    targets, sources, at, src = [], [], 0, 0
    for index, nbytes in enumerate(sizes):
        targets.append(slab[at : at + nbytes].view(torch.bfloat16))
        if index == 3:  # staged out of order: after a gap
            src += 512
        sources.append(arena[src : src + nbytes].view(torch.bfloat16))
        at, src = at + nbytes, src + nbytes
    tail = raw(slab[at:])
    pairs = list(zip(targets, sources, strict=True))
    landing = Landing.of(reversed(pairs))
    assert (landing.tensors, landing.nbytes, landing.runs) == (4, sum(sizes), 2)
    landing.run()
    for target, source in pairs:
        assert raw(target) == raw(source)
    assert raw(slab[at:]) == tail


def test_a_simulated_worker_stages_in_its_parameters_order_and_lands_in_one_copy() -> None:
    """The benchmarks' worker carves its parameters in the order the engine declared them
    (the model's, not the names' sort: ``w10`` before ``w9`` would scatter), 512-byte
    steps; an arena laid out in the order its span copies fill it (that same order) then
    mirrors them, and its landing is one copy of exact bytes."""
    declared = {f"w{i}": 1024 * (1 + i % 3) for i in (9, 10, 2, 11, 1)}
    sizes = {**declared, STAGING_REGION: 4096}
    memory = WorkerMemory("cpu", parameters=True)
    params, slabs = _parameters(sizes, memory)
    addresses = [params[name].data_ptr() for name in declared]
    assert addresses == sorted(addresses) and list(params) == list(declared)
    received = _Received.laid_out(sizes, params, slabs, memory, order=list(declared))
    assert (received.landing.runs, received.landing.tensors) == (1, len(declared))
    generator = torch.Generator().manual_seed(11)
    for name in declared:
        received.buffers[name].copy_(random_bytes(declared[name], generator))
    received.landing.run()
    for name in declared:
        assert raw(params[name]) == raw(received.buffers[name])

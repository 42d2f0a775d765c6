"""The receive layout both ends derive from a manifest, and CPU buckets in and out of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest, rollout_dtype
from mooncake_rl.protocol import ApplyRequest, BucketUpload, PrepareRequest
from mooncake_rl.transport.buckets import MalformedBucket, pack, shm_name, shm_path, unpack_into
from mooncake_rl.transport.layout import ALIGN, receive_layout

DTYPES = ("float32", "bfloat16", "float16")
specs = st.lists(
    st.builds(
        lambda i, shape, dtype: TensorSpec(f"layer.{i}.w", shape, dtype),
        st.integers(0, 10**6),
        st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=30,
    unique_by=lambda s: s.name,
)


def manifest_of(tensor_specs: list[TensorSpec]):
    return build_manifest("m", 1, tensor_specs, "2026-12-01T00:00:00+00:00")


@settings(max_examples=200, deadline=None)
@given(specs, st.integers(1, 20_000))
def test_buckets_hold_every_tensor_once_in_order_within_the_bound(
    tensor_specs: list[TensorSpec], bucket_bytes: int
) -> None:
    layout = receive_layout(manifest_of(tensor_specs), bucket_bytes)
    assert [t.name for t in layout.tensors] == [s.name for s in tensor_specs]
    end = 0
    for tensor, spec in zip(layout.tensors, tensor_specs, strict=True):
        assert tensor.offset % ALIGN == 0 and tensor.offset >= end  # aligned, no overlap
        assert tensor.nbytes == spec.nbytes and tensor.shape == spec.shape
        end = tensor.offset + tensor.nbytes
    assert layout.total_bytes == end
    for bucket in layout.buckets:
        inside = layout.bucket_tensors(bucket)
        assert bucket.start == inside[0].offset
        assert bucket.end == inside[-1].offset + inside[-1].nbytes
        # At most bucket_bytes, unless one tensor alone is larger.
        assert bucket.nbytes <= bucket_bytes or len(inside) == 1
    # Greedy: no bucket could have taken its successor's first tensor.
    for bucket, following in zip(layout.buckets, layout.buckets[1:], strict=False):
        first = layout.tensors[following.first]
        assert first.offset + first.nbytes - bucket.start > bucket_bytes


def test_a_layout_needs_a_positive_bucket_size() -> None:
    with pytest.raises(InvariantViolation, match="bucket_bytes must be positive"):
        receive_layout(manifest_of([TensorSpec("w", (2,), "float32")]), 0)


def full_tensors(tensor_specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        s.name: torch.randn(s.shape, generator=generator).to(rollout_dtype(s.dtype))
        for s in tensor_specs
    }


def test_a_bucket_lands_each_tensor_byte_exactly_at_its_offset() -> None:
    tensor_specs = [
        TensorSpec("a", (3, 5), "float32"),
        TensorSpec("b", (7,), "bfloat16"),
        TensorSpec("c", (4, 4), "float16"),
    ]
    layout = receive_layout(manifest_of(tensor_specs), 1 << 20)
    (bucket,) = layout.buckets
    tensors = full_tensors(tensor_specs)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    landed = unpack_into(pack(tensors), layout, bucket, buffer)
    assert landed == ["a", "b", "c"]
    for tensor in layout.tensors:
        raw = buffer[tensor.offset : tensor.offset + tensor.nbytes]
        expected = tensors[tensor.name].reshape(-1).view(torch.uint8)
        assert torch.equal(raw, expected)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: {**t, "extra": torch.zeros(1)}, "holds"),
        (lambda t: {k: v for k, v in t.items() if k != "b"}, "holds"),
        (lambda t: {**t, "a": t["a"].double()}, "arrived as torch.float64"),
        (lambda t: {**t, "a": t["a"].reshape(5, 3)}, r"\(5, 3\)"),
    ],
)
def test_a_bucket_that_is_not_the_layouts_is_refused(change, message: str) -> None:
    tensor_specs = [TensorSpec("a", (3, 5), "float32"), TensorSpec("b", (7,), "float32")]
    layout = receive_layout(manifest_of(tensor_specs), 1 << 20)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    with pytest.raises(MalformedBucket, match=message):
        unpack_into(pack(change(full_tensors(tensor_specs))), layout, layout.buckets[0], buffer)
    with pytest.raises(MalformedBucket, match="not safetensors"):
        unpack_into(b"\x00" * 32, layout, layout.buckets[0], buffer)


def test_only_mooncake_bucket_files_are_ever_opened() -> None:
    name = shm_name("a" * 32, 3)
    assert shm_path(name).name == name
    for hostile in ("../etc/passwd", "mooncake-rl-x-1", f"mooncake-rl-{'a' * 32}-1/../../x"):
        with pytest.raises(MalformedBucket):
            shm_path(hostile)


def prepare_body(**receive: object) -> dict[str, object]:
    return {
        "session": "a" * 32,
        "model": "m",
        "generation": 2,
        "manifest_digest": "0" * 64,
        "mode": "compat",
        "stages": 1,
        "workers": {},
        "receive": receive,
    }


GROUP = {
    "host": "10.0.0.1",
    "port": 29600,
    "world_size": 3,
    "rank_offset": 1,
    "name": "b" * 32,
    "backend": "gloo",
    "timeout_s": 30.0,
}


@pytest.mark.parametrize(
    "receive",
    [
        {"transport": "broadcast", "bucket_bytes": 1024},  # a broadcast without its group
        {"transport": "cpu_serialize", "bucket_bytes": 1024, "group": GROUP},
        {"transport": "broadcast", "bucket_bytes": 1024, "group": {**GROUP, "rank_offset": 3}},
        {"transport": "broadcast", "bucket_bytes": 1024, "group": {**GROUP, "port": 80}},
        {"transport": "nccl", "bucket_bytes": 1024},
        {"transport": "cpu_serialize", "bucket_bytes": 0},
    ],
)
def test_malformed_deliveries_fail_validation(receive: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PrepareRequest.model_validate(prepare_body(**receive))


def test_a_delivery_carries_no_routing_slices_and_lands_full_tensors() -> None:
    body = prepare_body(transport="cpu_serialize", bucket_bytes=1024)
    assert PrepareRequest.model_validate(body).receive is not None
    with pytest.raises(ValidationError, match="no routing slices"):
        PrepareRequest.model_validate({**body, "mode": "direct"})


def test_bucket_references_and_uploads_are_bounded() -> None:
    apply = {"session": "a" * 32, "generation": 2, "stage": 0, "peers": {}}
    good = ApplyRequest.model_validate(
        {**apply, "bucket": {"shm": shm_name("c" * 32, 0), "nbytes": 8}}
    )
    assert good.bucket is not None
    for shm in ("/dev/shm/x", "mooncake-rl-../../x-0"):
        with pytest.raises(ValidationError):
            ApplyRequest.model_validate({**apply, "bucket": {"shm": shm, "nbytes": 8}})
    query = {"session": "a" * 32, "generation": "2", "stage": "0"}
    assert BucketUpload.model_validate(query, strict=False).stage == 0
    with pytest.raises(ValidationError):
        BucketUpload.model_validate({**query, "stage": "-1"}, strict=False)

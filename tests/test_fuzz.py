"""Fuzzed decoding of everything a peer can send: random and mutated bytes, manifests, tensor
parts and weight-update payloads. Whatever comes in, decoding returns a checked value or raises
WireError with a message; never another exception, never a hang (every example has a deadline)."""

from __future__ import annotations

import inspect

import msgspec
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decentrl.net import protocol
from decentrl.net.identity import Identity
from decentrl.net.node import Envelope, signed_envelope, verify_envelope
from decentrl.net.wire import (
    DTYPES,
    TensorLimits,
    TensorManifest,
    TensorSpec,
    WireError,
    decode_struct,
    decode_tensors,
    encode_struct,
    encode_tensors,
    from_messages,
    to_messages,
)
from decentrl.rollout.types import Rollout, RolloutGroup, VersionSpan
from decentrl.sync.delta import (
    PublishedState,
    apply_payload,
    decode_payload,
    decode_varints,
    encode_delta,
    encode_keyframe,
    payload_bytes,
)

FUZZ = settings(max_examples=150, deadline=2000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Small limits, so a forged size is refused by a check, not by running out of memory.
LIMITS = TensorLimits(max_elements_per_tensor=2**16, max_total_bytes=2**20, max_tensors=16)

MESSAGE_TYPES = [cls for _, cls in inspect.getmembers(protocol, inspect.isclass)
                 if issubclass(cls, msgspec.Struct) and cls.__module__ == protocol.__name__]
MESSAGE_TYPES += [Envelope, TensorManifest, RolloutGroup]


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: 0 flips a byte, 1 inserts one, 2 deletes one."""
    out = bytearray(data)
    for kind, position, value in edits:
        if kind == 1 or not out:
            out.insert(position % (len(out) + 1), value)
        elif kind == 0:
            out[position % len(out)] ^= value or 1
        else:
            del out[position % len(out)]
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**16), st.integers(0, 255)),
                 min_size=1, max_size=8)


def sample_group() -> bytes:
    rollout = Rollout(prompt_tokens=[1, 2, 3], completion_tokens=[4, 5],
                      behaviour_logprobs=[-0.5, -1.0], finished=True, completion_text="45")
    return encode_struct(RolloutGroup(
        group_id="sums/7", task="sums", problem_index=7, stage_versions=[3, 2],
        version_spans=[VersionSpan(start=0, versions=[3, 2])], sampling_seed=11,
        rollouts=[rollout, rollout]))


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@FUZZ
@given(data=st.binary(max_size=256))
def test_random_bytes_never_decode_to_anything_but_a_struct_or_a_wire_error(
        message_type: type, data: bytes) -> None:
    try:
        value = decode_struct(data, message_type)
    except WireError as error:
        assert str(error).startswith(f"bad {message_type.__name__} message")
        return
    assert isinstance(value, message_type)


@FUZZ
@given(edits=EDITS)
def test_mutated_rollout_groups_decode_or_are_refused(edits: list[tuple[int, int, int]]) -> None:
    try:
        group = decode_struct(mutate(sample_group(), edits), RolloutGroup)
    except WireError:
        return
    assert isinstance(group, RolloutGroup) and all(isinstance(r, Rollout) for r in group.rollouts)


SPECS = st.builds(
    TensorSpec, name=st.sampled_from(["a", "b", "c"]),
    codec=st.sampled_from(["raw", "fp32", "bf16", "int8"]),
    dtype=st.sampled_from([*DTYPES, "float16", "complex64", ""]),
    shape=st.lists(st.integers(-2, 40), max_size=3).map(tuple),
    parts=st.integers(-1, 3))
PARTS = st.builds(
    runtime_pb2.Tensor, buffer=st.binary(max_size=512),
    size=st.lists(st.integers(0, 40), max_size=3),
    dtype=st.sampled_from([*DTYPES, "int16", "float16", "object", ""]),
    requires_grad=st.booleans(), compression=st.integers(0, 3), chunks=st.integers(0, 3))


@FUZZ
@given(specs=st.lists(SPECS, max_size=4), parts=st.lists(PARTS, max_size=5))
def test_forged_manifests_and_parts_decode_as_announced_or_are_refused(
        specs: list[TensorSpec], parts: list[runtime_pb2.Tensor]) -> None:
    manifest = TensorManifest(tuple(specs))
    try:
        tensors = decode_tensors(parts, manifest, LIMITS)
    except WireError:
        return
    for spec in specs:
        tensor = tensors[spec.name]
        assert tuple(tensor.shape) == spec.shape
        assert str(tensor.dtype).removeprefix("torch.") == spec.dtype
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all())


SENDER = Identity.generate()


@FUZZ
@given(edits=EDITS)
def test_mutated_tensor_messages_decode_or_are_refused(edits: list[tuple[int, int, int]]) -> None:
    """What a node does with a request: anything it accepts (the signature holds) decodes to
    exactly what the sender signed."""
    sent = {"hidden": torch.randn(2, 3, 4), "ids": torch.arange(6).reshape(2, 3)}
    parts, manifest = encode_tensors(sent, "int8")
    metadata = signed_envelope(SENDER, "request", "step", "abc", b"body", manifest, parts)
    messages = to_messages(runtime_pb2.ExpertRequest, metadata, parts, uid="abc")
    raw = mutate(b"".join(m.SerializeToString() for m in messages), edits)
    try:
        message = runtime_pb2.ExpertRequest.FromString(raw)
    except DecodeError:  # protobuf refusing garbage is the node's first check
        return
    try:
        uid, metadata, got = from_messages([message])
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(SENDER.peer_id, "request", "step", uid, envelope, got)
        tensors = decode_tensors(got, envelope.manifest, LIMITS)
    except WireError:  # SignatureError included
        return
    assert uid == "abc" and envelope.body == b"body"
    assert tensors.keys() == sent.keys()
    assert torch.equal(tensors["ids"], sent["ids"])
    expected = decode_tensors(parts, manifest)["hidden"]
    assert torch.equal(tensors["hidden"], expected)


def published() -> PublishedState:
    g = torch.Generator().manual_seed(0)
    return PublishedState.of(0, {"w": torch.randn(40, 30, generator=g),
                                 "b": torch.randn(7, generator=g)})


def delta_payload() -> bytes:
    state = published()
    moved = {n: t + 0.01 * torch.randn(t.shape) for n, t in state.tensors.items()}
    return payload_bytes(encode_delta(state, moved, 0.2))


@FUZZ
@given(edits=EDITS, keyframe=st.booleans())
def test_mutated_update_payloads_apply_cleanly_or_are_refused(
        edits: list[tuple[int, int, int]], keyframe: bool) -> None:
    data = payload_bytes(encode_keyframe(published())) if keyframe else delta_payload()
    state = published()
    shapes = {n: t.shape for n, t in state.tensors.items()}
    try:
        apply_payload(state, decode_payload(mutate(data, edits), shapes), 1)
    except WireError:
        assert state.version == 0  # refused before anything changed
        assert all(torch.equal(t, published().tensors[n]) for n, t in state.tensors.items())
        return
    assert all(bool(torch.isfinite(t).all()) for t in state.tensors.values())
    assert {n: t.shape for n, t in state.tensors.items()} == shapes


@FUZZ
@given(data=st.binary(max_size=64), count=st.integers(0, 20))
def test_random_varints_decode_or_are_refused(data: bytes, count: int) -> None:
    try:
        values = decode_varints(data, count)
    except WireError:
        return
    assert len(values) == count and values.dtype == np.uint64

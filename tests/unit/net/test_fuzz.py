"""Fuzzed decoding of everything a peer can send: random and mutated bytes, manifests, tensor
parts and weight-update payloads. Whatever comes in, decoding returns a checked value or raises
WireError with a message; never another exception, never a hang (every example has a deadline).

Each test counts its examples by outcome and asserts that some were accepted and some refused
(tests/fuzzing.py), so the checks of both branches run. The number of examples comes from
hypothesis's profile (tests/conftest.py): a few hundred per test in `make test`, thousands in
`make fuzz`."""

from __future__ import annotations

import inspect

import msgspec
import numpy as np
import pytest
import torch
from fuzzing import EDITS, FUZZ, Edits, Outcomes, flip, message_bytes, mutate
from google.protobuf.message import DecodeError
from hivemind.proto import runtime_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from decentrl.net import protocol
from decentrl.net.identity import Identity
from decentrl.net.signing import Envelope, signed_envelope, verify_envelope
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

# Small limits, so a forged size is refused by a check, not by running out of memory.
LIMITS = TensorLimits(max_elements_per_tensor=2**16, max_total_bytes=2**20, max_tensors=16)

MESSAGE_TYPES = [cls for _, cls in inspect.getmembers(protocol, inspect.isclass)
                 if issubclass(cls, msgspec.Struct) and cls.__module__ == protocol.__name__]
MESSAGE_TYPES += [Envelope, TensorManifest, RolloutGroup]


# ---- any bytes as every message type ------------------------------------------------------------

@FUZZ
@given(data=st.data())
def decode_any_bytes(message_type: type, outcomes: Outcomes, data: st.DataObject) -> None:
    sent = data.draw(message_bytes(message_type), label="sent")
    try:
        value = decode_struct(sent, message_type)
    except WireError as error:
        assert str(error).startswith(f"bad {message_type.__name__} message")
        outcomes.refuse()
        return
    assert isinstance(value, message_type)
    # What was accepted is passed on as it is: re-encoded, it decodes to the same message
    # (compared as bytes, as a NaN equals nothing).
    encoded = encode_struct(value)
    assert encode_struct(decode_struct(encoded, message_type)) == encoded
    outcomes.accept()


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_any_bytes_decode_to_a_struct_of_their_type_or_a_wire_error(
        message_type: type, fuzz_outcomes: Outcomes) -> None:
    decode_any_bytes(message_type, fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- mutated rollout groups ----------------------------------------------------------------------

def sample_group() -> bytes:
    rollout = Rollout(prompt_tokens=[1, 2, 3], completion_tokens=[4, 5],
                      behaviour_logprobs=[-0.5, -1.0], finished=True)
    return encode_struct(RolloutGroup(
        group_id="sums/7", task="sums", problem_index=7, stage_versions=[3, 2],
        version_spans=[VersionSpan(start=0, versions=[3, 2])], sampling_seed=11,
        rollouts=[rollout, rollout]))


SAMPLE_GROUP = sample_group()


@FUZZ
@given(edits=EDITS)
@example(edits=flip(SAMPLE_GROUP.index(b"sums/7") + 5, 0x01))  # group id "sums/6"
def decode_mutated_group(outcomes: Outcomes, edits: Edits) -> None:
    try:
        group = decode_struct(mutate(SAMPLE_GROUP, edits), RolloutGroup)
    except WireError:
        outcomes.refuse()
        return
    assert isinstance(group, RolloutGroup) and all(isinstance(r, Rollout) for r in group.rollouts)
    outcomes.accept()


def test_mutated_rollout_groups_decode_or_are_refused(fuzz_outcomes: Outcomes) -> None:
    decode_mutated_group(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- forged manifests and tensor parts -----------------------------------------------------------

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
# What an honest sender sends: forged ones are refused unless they happen to be as consistent.
HONEST_PARTS, HONEST_MANIFEST = encode_tensors(
    {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4).reshape(4, 1)}, "int8")


@FUZZ
@given(specs=st.lists(SPECS, max_size=4), parts=st.lists(PARTS, max_size=5))
@example(specs=list(HONEST_MANIFEST.tensors), parts=HONEST_PARTS)
def decode_forged_tensors(outcomes: Outcomes, specs: list[TensorSpec],
                          parts: list[runtime_pb2.Tensor]) -> None:
    manifest = TensorManifest(tuple(specs))
    try:
        tensors = decode_tensors(parts, manifest, LIMITS)
    except WireError:
        outcomes.refuse()
        return
    for spec in specs:
        tensor = tensors[spec.name]
        assert tuple(tensor.shape) == spec.shape
        assert str(tensor.dtype).removeprefix("torch.") == spec.dtype
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all())
    outcomes.accept()


def test_forged_manifests_and_parts_decode_as_announced_or_are_refused(
        fuzz_outcomes: Outcomes) -> None:
    decode_forged_tensors(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- mutated signed requests ---------------------------------------------------------------------

SENDER = Identity.generate()
_generator = torch.Generator().manual_seed(0)
SENT = {"hidden": torch.randn(2, 3, 4, generator=_generator),
        "ids": torch.arange(6).reshape(2, 3)}
SENT_PARTS, SENT_MANIFEST = encode_tensors(SENT, "int8")
SIGNED_REQUEST = b"".join(message.SerializeToString() for message in to_messages(
    runtime_pb2.ExpertRequest,
    signed_envelope(SENDER, "request", "step", "abc", b"body", SENT_MANIFEST, SENT_PARTS),
    SENT_PARTS, uid="abc"))
# Field 127 (unknown to ExpertRequest) as a varint 0, appended: a change to the bytes that leaves
# everything signed as it was. Protobuf skips unknown fields, so the request must be accepted.
UNKNOWN_FIELD = bytes([0xF8, 0x07, 0x00])
APPEND_UNKNOWN_FIELD = [(1, len(SIGNED_REQUEST) + i, byte) for i, byte in enumerate(UNKNOWN_FIELD)]


@FUZZ
@given(edits=EDITS)
@example(edits=APPEND_UNKNOWN_FIELD)
def decode_mutated_request(outcomes: Outcomes, edits: Edits) -> None:
    raw = mutate(SIGNED_REQUEST, edits)
    try:
        message = runtime_pb2.ExpertRequest.FromString(raw)
    except DecodeError:  # protobuf refusing garbage is the node's first check
        outcomes.refuse()
        return
    try:
        uid, metadata, got = from_messages([message])
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(SENDER.peer_id, "request", "step", uid, envelope, got)
        tensors = decode_tensors(got, envelope.manifest, LIMITS)
    except WireError:  # SignatureError included
        outcomes.refuse()
        return
    assert uid == "abc" and envelope.body == b"body"
    assert tensors.keys() == SENT.keys()
    assert torch.equal(tensors["ids"], SENT["ids"])
    expected = decode_tensors(SENT_PARTS, SENT_MANIFEST)["hidden"]
    assert torch.equal(tensors["hidden"], expected)
    outcomes.accept()


def test_mutated_tensor_messages_decode_or_are_refused(fuzz_outcomes: Outcomes) -> None:
    """What a node does with a request: anything it accepts (the signature holds) decodes to
    exactly what the sender signed."""
    assert mutate(SIGNED_REQUEST, APPEND_UNKNOWN_FIELD) == SIGNED_REQUEST + UNKNOWN_FIELD
    decode_mutated_request(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- mutated weight-update payloads --------------------------------------------------------------

def published() -> PublishedState:
    g = torch.Generator().manual_seed(0)
    return PublishedState.of(0, {"w": torch.randn(40, 30, generator=g),
                                 "b": torch.randn(7, generator=g)})


def delta_payload() -> bytes:
    state = published()
    g = torch.Generator().manual_seed(1)
    moved = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in state.tensors.items()}
    return payload_bytes(encode_delta(state, moved, 0.2))


# Encoded once: every example mutates a copy.
PAYLOADS = {False: delta_payload(), True: payload_bytes(encode_keyframe(published()))}
PUBLISHED = published()
SHAPES = {n: t.shape for n, t in PUBLISHED.tensors.items()}


@FUZZ
@given(edits=EDITS, keyframe=st.booleans())
# The last byte is one of the last block's int8 values: any value is a valid delta.
@example(edits=flip(len(PAYLOADS[False]) - 1, 0x01), keyframe=False)
def apply_mutated_payload(outcomes: Outcomes, edits: Edits, keyframe: bool) -> None:
    state = published()
    try:
        apply_payload(state, decode_payload(mutate(PAYLOADS[keyframe], edits), SHAPES), 1)
    except WireError:
        assert state.version == 0  # refused before anything changed
        assert all(torch.equal(t, PUBLISHED.tensors[n]) for n, t in state.tensors.items())
        outcomes.refuse()
        return
    assert all(bool(torch.isfinite(t).all()) for t in state.tensors.values())
    assert {n: t.shape for n, t in state.tensors.items()} == SHAPES
    outcomes.accept()


def test_mutated_update_payloads_apply_cleanly_or_are_refused(fuzz_outcomes: Outcomes) -> None:
    apply_mutated_payload(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()


# ---- random varints ------------------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=64), count=st.integers(0, 20))
@example(data=bytes([0x96, 0x01, 0x05]), count=2)  # 150 and 5
def decode_random_varints(outcomes: Outcomes, data: bytes, count: int) -> None:
    try:
        values = decode_varints(data, count)
    except WireError:
        outcomes.refuse()
        return
    assert len(values) == count and values.dtype == np.uint64
    outcomes.accept()


def test_random_varints_decode_or_are_refused(fuzz_outcomes: Outcomes) -> None:
    decode_random_varints(fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
from hivemind.proto import runtime_pb2

from decentrl.net.wire import (
    MAX_MESSAGE_BYTES,
    TensorLimits,
    TensorManifest,
    TensorSpec,
    WireError,
    decode_struct,
    decode_tensor,
    decode_tensors,
    encode_struct,
    encode_tensor,
    encode_tensors,
    from_messages,
    message_bytes,
    to_messages,
)


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step: int
    manifest: TensorManifest


def activations(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def round_trip(tensors, codec="fp32", limits=None) -> dict[str, torch.Tensor]:
    """Through every layer: parts, metadata bytes, messages and back."""
    parts, manifest = encode_tensors(tensors, codec)
    messages = to_messages(runtime_pb2.ExpertRequest, encode_struct(Request(3, manifest)), parts,
                           uid="stage1.forward")
    uid, metadata, received = from_messages(messages)
    assert uid == "stage1.forward"
    request = decode_struct(metadata, Request)
    assert request.step == 3
    return decode_tensors(received, request.manifest, limits)


def replace_spec(manifest: TensorManifest, index: int = 0, **changes) -> TensorManifest:
    specs = list(manifest.tensors)
    specs[index] = msgspec.structs.replace(specs[index], **changes)
    return TensorManifest(tuple(specs))


def test_fp32_and_bf16_round_trip() -> None:
    x = activations(4, 16)
    out = round_trip({"h": x, "h16": x.to(torch.bfloat16)}, "fp32")
    assert out["h"].dtype == torch.float32 and torch.equal(out["h"], x)
    assert torch.equal(out["h16"], x.to(torch.bfloat16).float())
    out = round_trip([x], "bf16")
    assert list(out) == ["0"]
    assert out["0"].dtype == torch.bfloat16 and torch.equal(out["0"], x.to(torch.bfloat16))
    out["0"] += 1  # a writable tensor, not a view of the message


def test_int8_round_trip_error_is_within_a_step() -> None:
    x = activations(3, 5, 64) * torch.tensor([0.01, 1.0, 100.0]).view(3, 1, 1)
    x[1, 2] = 0.0  # a zero row must not divide by zero
    out = round_trip({"h": x}, "int8")["h"]
    assert out.dtype == torch.float32 and out.shape == x.shape
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert bool(((out - x).abs() <= step + 1e-6 * x.abs().amax()).all())
    assert bool((out[1, 2] == 0).all())


def test_int8_scalar_and_empty_fall_back_to_fp32() -> None:
    for t in (torch.tensor(2.5), torch.zeros(3, 0)):
        parts, spec = encode_tensor(t, "int8", "t")
        assert spec.codec == "fp32" and len(parts) == 1
        assert torch.equal(decode_tensor(parts, spec), t)


def test_integer_and_bool_tensors_are_exact() -> None:
    tensors = {"ids": torch.tensor([[1, 2**40, -3]]), "mask": torch.tensor([True, False, True]),
               "pos": torch.arange(5, dtype=torch.int32),
               "bytes": torch.arange(7, dtype=torch.uint8), "scalar": torch.tensor(7)}
    for codec in ("fp32", "bf16", "int8"):
        out = round_trip(tensors, codec)
        for name, t in tensors.items():
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), (codec, name)


def test_codecs_shrink_the_bytes() -> None:
    x = activations(8, 512)
    size = {codec: message_bytes(to_messages(runtime_pb2.ExpertResponse, b"",
                                             encode_tensors([x], codec)[0]))
            for codec in ("fp32", "bf16", "int8")}
    assert size["bf16"] == pytest.approx(size["fp32"] / 2, rel=0.02)
    assert size["int8"] == pytest.approx(size["fp32"] / 4, rel=0.02)


def test_non_finite_values_are_rejected() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = activations(2, 4)
        x[1, 2] = bad
        with pytest.raises(WireError, match="'h' has non-finite"):
            encode_tensors({"h": x})
        # A sender that skips the check: the receiver still refuses.
        wire = {"fp32": x, "bf16": x.to(torch.bfloat16).view(torch.int16)}
        for codec, payload in wire.items():
            parts, manifest = encode_tensors({"h": activations(2, 4)}, codec)  # type: ignore
            parts[0].buffer = payload.numpy().tobytes()
            with pytest.raises(WireError, match="'h' has non-finite"):
                decode_tensors(parts, manifest)


def test_bad_int8_scales_are_rejected() -> None:
    parts, manifest = encode_tensors({"h": activations(2, 4)}, "int8")
    for bad in (-1.0, float("nan"), float("inf")):
        parts[1].buffer = torch.tensor([0.1, bad]).numpy().tobytes()
        with pytest.raises(WireError, match="'h': int8 scales must be finite and >= 0"):
            decode_tensors(parts, manifest)


def test_part_count_must_match() -> None:
    parts, manifest = encode_tensors({"a": activations(2), "b": activations(3)})
    with pytest.raises(WireError, match="manifest lists 2 parts for 2 tensors, message has 1"):
        decode_tensors(parts[:1], manifest)
    with pytest.raises(WireError, match="message has 3"):
        decode_tensors(parts + parts[:1], manifest)
    with pytest.raises(WireError, match="'a': codec fp32 takes 1 parts, manifest says 2"):
        decode_tensors(parts, replace_spec(manifest, parts=2))
    with pytest.raises(WireError, match="'a': expected 1 parts, got 2"):
        decode_tensor(parts, manifest.tensors[0])


def test_buffer_size_must_match_the_shape() -> None:
    parts, manifest = encode_tensors({"h": activations(2, 4)})
    parts[0].buffer = parts[0].buffer[:-1]
    with pytest.raises(WireError, match=r"'h' data: buffer is 31 bytes, shape \[2, 4\] of "
                                        r"float32 needs 32"):
        decode_tensors(parts, manifest)


def test_part_header_must_match_the_manifest() -> None:
    parts, manifest = encode_tensors({"h": activations(2, 4)})
    with pytest.raises(WireError, match=r"'h' data: shape expected \[4, 2\], got \[2, 4\]"):
        decode_tensors(parts, replace_spec(manifest, shape=(4, 2)))
    with pytest.raises(WireError, match="negative dimension"):
        decode_tensors(parts, replace_spec(manifest, shape=(-2, -4)))
    with pytest.raises(WireError, match="decodes to float32, manifest says int64"):
        decode_tensors(parts, replace_spec(manifest, dtype="int64"))
    with pytest.raises(WireError, match="unknown dtype 'complex64'"):
        decode_tensors(parts, replace_spec(manifest, dtype="complex64"))
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(parts[0])
    bad.dtype = "int32"
    with pytest.raises(WireError, match="'h' data: dtype expected float32, got 'int32'"):
        decode_tensors([bad], manifest)
    bad.CopyFrom(parts[0])
    bad.compression = runtime_pb2.CompressionType.FLOAT16
    with pytest.raises(WireError, match="compression must be NONE"):
        decode_tensors([bad], manifest)
    bad.CopyFrom(parts[0])
    bad.requires_grad = True
    with pytest.raises(WireError, match="requires_grad"):
        decode_tensors([bad], manifest)
    twice = TensorManifest(manifest.tensors * 2)
    with pytest.raises(WireError, match="'h' appears twice"):
        decode_tensors(parts * 2, twice)


def test_limits() -> None:
    parts, manifest = encode_tensors({"big": activations(10, 10), "ids": torch.arange(4)})
    with pytest.raises(WireError, match="'big': 100 elements .* over the limit of 99"):
        decode_tensors(parts, manifest, TensorLimits(max_elements_per_tensor=99))
    with pytest.raises(WireError, match="2 tensors is over the limit of 1"):
        decode_tensors(parts, manifest, TensorLimits(max_tensors=1))
    with pytest.raises(WireError, match="total 432 bytes, over the limit of 400"):
        decode_tensors(parts, manifest, TensorLimits(max_total_bytes=400))
    with pytest.raises(WireError, match="'ids': dtype int64 is not allowed"):
        decode_tensors(parts, manifest, TensorLimits(allowed_dtypes=frozenset({"float32"})))
    # A huge claimed shape is refused before anything is allocated.
    with pytest.raises(WireError, match="over the limit"):
        decode_tensors(parts, replace_spec(manifest, shape=(2**31, 2**31)))
    with pytest.raises(ValueError, match="max_tensors"):
        TensorLimits(max_tensors=0)
    with pytest.raises(ValueError, match="allowed_dtypes"):
        TensorLimits(allowed_dtypes=frozenset({"float64"}))


def test_unsupported_dtype_is_refused_on_send() -> None:
    with pytest.raises(WireError, match="dtype complex64 cannot be sent"):
        encode_tensors({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="codec"):
        encode_tensors([torch.zeros(2)], "fp8")  # type: ignore[arg-type]


def test_bad_metadata_is_a_wire_error() -> None:
    manifest = encode_tensors([torch.zeros(2)])[1]
    good = encode_struct(Request(1, manifest))
    assert decode_struct(good, Request) == Request(1, manifest)
    with pytest.raises(WireError, match="bad Request message"):
        decode_struct(b"\xc1garbage", Request)
    with pytest.raises(WireError, match="bad Request message"):
        decode_struct(good[:-3], Request)
    with pytest.raises(WireError, match="bad Request message: .*unknown field `extra`"):
        decode_struct(encode_struct({"step": 1, "manifest": manifest, "extra": 0}), Request)
    with pytest.raises(WireError, match="bad Request message: .*missing required field `step`"):
        decode_struct(encode_struct({"manifest": manifest}), Request)
    with pytest.raises(WireError, match="bad Request message: Expected `int`, got `str`"):
        decode_struct(encode_struct({"step": "1", "manifest": manifest}), Request)
    spec = msgspec.structs.asdict(manifest.tensors[0]) | {"codec": "pickle"}
    with pytest.raises(WireError, match="bad TensorManifest message: .*codec"):
        decode_struct(encode_struct({"tensors": [spec]}), TensorManifest)


def test_chunking_keeps_every_message_under_the_cap() -> None:
    big = activations(1_500_000)  # 6 MB of float32
    tensors = {"empty": torch.zeros(0), "big": big, "ids": torch.arange(3)}
    parts, manifest = encode_tensors(tensors)
    messages = to_messages(runtime_pb2.ExpertRequest, encode_struct(manifest), parts, uid="u")
    assert len(messages) >= 2
    assert all(m.ByteSize() < MAX_MESSAGE_BYTES for m in messages)
    assert messages[0].uid == "u" and all(not m.uid and not m.metadata for m in messages[1:])
    assert message_bytes(messages) > big.numel() * 4
    uid, metadata, received = from_messages(messages)
    out = decode_tensors(received, decode_struct(metadata, TensorManifest))
    for name, t in tensors.items():
        assert torch.equal(out[name], t)
    # Responses have no uid; a lost message in the middle is caught.
    responses = to_messages(runtime_pb2.ExpertResponse, b"m", parts, chunk_bytes=2**19)
    assert all(r.ByteSize() < MAX_MESSAGE_BYTES for r in responses)
    assert from_messages(responses)[:2] == ("", b"m")
    assert len(responses) >= 3
    with pytest.raises(WireError, match="chunk"):
        from_messages(responses[:1] + responses[2:])
    with pytest.raises(ValueError, match="no uid field"):
        to_messages(runtime_pb2.ExpertResponse, b"", parts, uid="u")
    with pytest.raises(ValueError, match="chunk_bytes"):
        to_messages(runtime_pb2.ExpertResponse, b"", parts, chunk_bytes=MAX_MESSAGE_BYTES)


def test_no_tensors_is_one_message() -> None:
    messages = to_messages(runtime_pb2.ExpertRequest, b"meta", [], uid="ping")
    assert len(messages) == 1
    assert from_messages(messages) == ("ping", b"meta", [])
    with pytest.raises(WireError, match="no messages"):
        from_messages([])


def test_limits_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field"):
        TensorLimits().max_tensors = 1  # type: ignore[misc]
    assert TensorSpec("a", "raw", "int64", (1,), 1).parts == 1

"""Tensors and messages on the wire between peers. Nothing here unpickles: metadata is msgpack
decoded strictly into msgspec structs, tensors are raw little-endian buffers, and every buffer is
checked against its manifest before hivemind's deserializer (which trusts its input) sees it.

A peer message is a hivemind `ExpertRequest` / `ExpertResponse`: `tensors` carries the parts,
`metadata` carries a msgspec struct (the caller's own struct, with a `TensorManifest` field).

How tensors are laid out:
- `encode_tensors` turns logical tensors into a flat list of hivemind `runtime_pb2.Tensor` parts
  plus a `TensorManifest`, whose `TensorSpec`s say, in order, each tensor's name, codec, dtype,
  shape and number of parts; the receiver walks the parts with it.
- Codecs, all over hivemind's NONE compression (raw bytes):
  "raw"  - integer and bool tensors, always, unchanged (both round-trip through NONE): 1 part.
  "fp32" - floating tensors as float32: 1 part.
  "bf16" - floating tensors as bfloat16, decoded as bfloat16: 1 part. The part is the bf16 bits
           as int16, because hivemind's NONE codec by default (USE_LEGACY_BFLOAT16=1) widens
           bfloat16 to float32 and would double the bytes.
  "int8" - floating tensors quantized per row (a row is the last dimension): an int8 part of the
           tensor's shape, then a float32 part of the per-row scales absmax/127 (shape[:-1]),
           decoded to float32. The error is at most half a step, scale/2, per element. A scalar
           or empty tensor has no rows, so it goes "fp32" instead; the spec says so.
- Hivemind's p2p unary messages are capped at 4 MiB, so `to_messages` cuts parts into chunks
  with hivemind's `split_for_streaming` and packs them into several messages, each under the cap;
  the first carries the uid and the metadata. `from_messages` puts the parts back together.

Send: parts, manifest = encode_tensors(...); metadata = encode_struct(MyRequest(manifest, ...));
messages = to_messages(ExpertRequest, metadata, parts, uid=...).
Receive: uid, metadata, parts = from_messages(messages); request = decode_struct(metadata,
MyRequest); tensors = decode_tensors(parts, request.manifest, limits)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import msgspec
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from decentrl.errors import SenderFault

T = TypeVar("T")
Message = TypeVar("Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)

ActivationCodec = Literal["fp32", "bf16", "int8"]
TensorCodec = Literal["raw", "fp32", "bf16", "int8"]

# Hivemind's cap on one p2p message (DEFAULT_MAX_MSG_SIZE of its daemon bindings).
MAX_MESSAGE_BYTES = 4 * 2**20
# What `to_messages` packs into one message by default: a margin under the cap for the envelope.
DEFAULT_MESSAGE_BYTES = 3 * 2**20
DEFAULT_CHUNK_BYTES = 2**20

# The dtypes that may cross the wire, by hivemind's name for them.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_RAW_DTYPES = frozenset(name for name, dtype in DTYPES.items() if not dtype.is_floating_point)
_CODEC_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "int8": "float32"}
_NONE = runtime_pb2.CompressionType.NONE


class WireError(SenderFault):
    """A message failed a check. The text names what: which tensor, which field, expected vs got."""


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One logical tensor of a message: what the receiver gets back and how many parts make it."""

    name: str
    codec: TensorCodec
    dtype: str  # of the decoded tensor
    shape: tuple[int, ...]
    parts: int


class TensorManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tensors: tuple[TensorSpec, ...] = ()


@dataclass(frozen=True)
class TensorLimits:
    """What a receiver accepts in one message; anything more is a WireError before any decoding."""

    max_elements_per_tensor: int = 2**27
    max_total_bytes: int = 2**30
    max_tensors: int = 4096
    allowed_dtypes: frozenset[str] = frozenset(DTYPES)

    def __post_init__(self) -> None:
        for name in ("max_elements_per_tensor", "max_total_bytes", "max_tensors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = set(self.allowed_dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"allowed_dtypes has unknown dtypes {sorted(unknown)}; "
                             f"known: {sorted(DTYPES)}")


# --- metadata ---------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode_struct(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def decode_struct(data: bytes | bytearray, type_: type[T]) -> T:
    """Strict msgpack decoding into `type_`: the first check on anything a peer sends."""
    decoder = _DECODERS.get(type_)
    if decoder is None:
        decoder = _DECODERS[type_] = msgspec.msgpack.Decoder(type_, strict=True)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as error:  # ValidationError included
        raise WireError(f"bad {getattr(type_, '__name__', type_)} message: {error}") from None


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The base of an RPC's body and of a DHT record (net/protocol.py): decoded by
    `decode_struct`, where an unknown field is an error like a missing one."""


# --- tensors ----------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor) -> runtime_pb2.Tensor:
    return serialize_torch_tensor(t.contiguous(), _NONE)


def encode_tensor(t: torch.Tensor, codec: ActivationCodec = "fp32", name: str = ""
                  ) -> tuple[list[runtime_pb2.Tensor], TensorSpec]:
    """One logical tensor as its parts and its spec. Integer and bool tensors always go raw;
    `codec` applies to floating ones. Refuses non-finite floats: the receiver would reject them."""
    if codec not in _CODEC_DTYPE:
        raise ValueError(f"codec must be one of {get_args(ActivationCodec)}, got {codec!r}")
    t = t.detach().to("cpu")
    shape = tuple(t.shape)
    if not t.dtype.is_floating_point:
        dtype = _dtype_name(t.dtype)
        if dtype not in _RAW_DTYPES:
            raise WireError(f"tensor {name!r}: dtype {dtype} cannot be sent; "
                            f"supported: {sorted(DTYPES)} and floating dtypes")
        return [_raw(t)], TensorSpec(name, "raw", dtype, shape, 1)
    if not bool(torch.isfinite(t).all()):
        raise WireError(f"tensor {name!r} has non-finite values (NaN or inf); refusing to send")
    if codec == "int8" and (t.dim() == 0 or t.numel() == 0):
        codec = "fp32"
    if codec == "fp32":
        return [_raw(t.to(torch.float32))], TensorSpec(name, "fp32", "float32", shape, 1)
    if codec == "bf16":
        bits = t.to(torch.bfloat16).view(torch.int16)
        return [_raw(bits)], TensorSpec(name, "bf16", "bfloat16", shape, 1)
    x = t.to(torch.float32)
    scales = x.abs().amax(dim=-1) / 127.0
    # A zero row has scale 0; divide by 1 there so it quantizes to zeros, not NaNs.
    q = torch.round(x / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)).clamp_(-127, 127)
    parts = [_raw(q.to(torch.int8)), _raw(scales)]
    return parts, TensorSpec(name, "int8", "float32", shape, 2)


def encode_tensors(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                   codec: ActivationCodec = "fp32"
                   ) -> tuple[list[runtime_pb2.Tensor], TensorManifest]:
    """Parts and manifest for several tensors. A sequence's tensors are named "0", "1", ...;
    `decode_tensors` gives them back in order either way."""
    named = tensors.items() if isinstance(tensors, Mapping) else (
        (str(index), t) for index, t in enumerate(tensors))
    parts: list[runtime_pb2.Tensor] = []
    specs: list[TensorSpec] = []
    for name, t in named:
        tensor_parts, spec = encode_tensor(t, codec, name)
        parts.extend(tensor_parts)
        specs.append(spec)
    return parts, TensorManifest(tuple(specs))


def _expected_parts(spec: TensorSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(what, wire dtype, shape) of each part a valid spec must come with."""
    if spec.codec == "raw":
        return [("data", spec.dtype, spec.shape)]
    if spec.codec == "bf16":
        return [("data", "int16", spec.shape)]
    if spec.codec == "fp32":
        return [("data", "float32", spec.shape)]
    return [("int8 data", "int8", spec.shape), ("int8 scales", "float32", spec.shape[:-1])]


def _check_spec(spec: TensorSpec, limits: TensorLimits) -> int:
    """Checks a spec alone; returns the bytes of the tensor it decodes to."""
    where = f"tensor {spec.name!r}"
    if spec.dtype not in DTYPES:
        raise WireError(f"{where}: unknown dtype {spec.dtype!r}")
    if spec.dtype not in limits.allowed_dtypes:
        raise WireError(f"{where}: dtype {spec.dtype} is not allowed; "
                        f"allowed: {sorted(limits.allowed_dtypes)}")
    if spec.codec == "raw" and spec.dtype not in _RAW_DTYPES:
        raise WireError(f"{where}: codec raw is for integer and bool tensors, got {spec.dtype}")
    if spec.codec != "raw" and spec.dtype != _CODEC_DTYPE[spec.codec]:
        raise WireError(f"{where}: codec {spec.codec} decodes to {_CODEC_DTYPE[spec.codec]}, "
                        f"manifest says {spec.dtype}")
    if any(dim < 0 for dim in spec.shape):
        raise WireError(f"{where}: negative dimension in shape {list(spec.shape)}")
    if spec.codec == "int8" and (len(spec.shape) == 0 or 0 in spec.shape):
        raise WireError(f"{where}: codec int8 needs a non-empty tensor with rows, "
                        f"got shape {list(spec.shape)}")
    numel = math.prod(spec.shape)
    if numel > limits.max_elements_per_tensor:
        raise WireError(f"{where}: {numel} elements (shape {list(spec.shape)}) is over the limit "
                        f"of {limits.max_elements_per_tensor}")
    expected = len(_expected_parts(spec))
    if spec.parts != expected:
        raise WireError(f"{where}: codec {spec.codec} takes {expected} parts, "
                        f"manifest says {spec.parts}")
    return numel * DTYPES[spec.dtype].itemsize


def _check_part(part: runtime_pb2.Tensor, where: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Everything hivemind's deserializer would otherwise trust."""
    if part.compression != _NONE:
        raise WireError(f"{where}: compression must be NONE (0), got {part.compression}")
    if part.dtype != dtype:
        raise WireError(f"{where}: dtype expected {dtype}, got {part.dtype!r}")
    if tuple(part.size) != shape:
        raise WireError(f"{where}: shape expected {list(shape)}, got {list(part.size)}")
    if part.requires_grad:
        raise WireError(f"{where}: requires_grad must be false")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if len(part.buffer) != expected:
        raise WireError(f"{where}: buffer is {len(part.buffer)} bytes, shape {list(shape)} of "
                        f"{dtype} needs {expected}")


def decode_tensor(parts: Sequence[runtime_pb2.Tensor], spec: TensorSpec,
                  limits: TensorLimits | None = None) -> torch.Tensor:
    """The tensor `spec` describes, from exactly its parts, after checking both."""
    limits = limits or TensorLimits()
    nbytes = _check_spec(spec, limits)
    if nbytes > limits.max_total_bytes:
        raise WireError(f"tensor {spec.name!r}: {nbytes} bytes is over the limit of "
                        f"{limits.max_total_bytes}")
    expected = _expected_parts(spec)
    if len(parts) != len(expected):
        raise WireError(f"tensor {spec.name!r}: expected {len(expected)} parts, got {len(parts)}")
    for part, (what, dtype, shape) in zip(parts, expected):
        _check_part(part, f"tensor {spec.name!r} {what}", dtype, shape)
    # Hivemind copies the buffer into a bytearray, so callers may write to what they get.
    raw = [deserialize_torch_tensor(part) for part in parts]
    if spec.codec == "raw" or spec.codec == "fp32":
        t = raw[0]
    elif spec.codec == "bf16":
        t = raw[0].view(torch.bfloat16)
    else:
        q, scales = raw
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise WireError(f"tensor {spec.name!r}: int8 scales must be finite and >= 0")
        t = q.to(torch.float32) * scales.unsqueeze(-1)
    if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        raise WireError(f"tensor {spec.name!r} has non-finite values (NaN or inf)")
    return t


def decode_tensors(parts: Sequence[runtime_pb2.Tensor], manifest: TensorManifest,
                   limits: TensorLimits | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a message, by name, in manifest order (`list(result.values())` for a
    message encoded from a sequence). All the manifest checks happen before any decoding."""
    limits = limits or TensorLimits()
    specs = manifest.tensors
    if len(specs) > limits.max_tensors:
        raise WireError(f"{len(specs)} tensors is over the limit of {limits.max_tensors}")
    total = 0
    names: set[str] = set()
    for spec in specs:
        if spec.name in names:
            raise WireError(f"tensor {spec.name!r} appears twice in the manifest")
        names.add(spec.name)
        total += _check_spec(spec, limits)
    if total > limits.max_total_bytes:
        raise WireError(f"tensors total {total} bytes, over the limit of {limits.max_total_bytes}")
    expected_parts = sum(spec.parts for spec in specs)
    if len(parts) != expected_parts:
        raise WireError(f"manifest lists {expected_parts} parts for {len(specs)} tensors, "
                        f"message has {len(parts)}")
    wire_bytes = sum(len(part.buffer) for part in parts)
    if wire_bytes > limits.max_total_bytes:
        raise WireError(f"tensor buffers total {wire_bytes} bytes, over the limit of "
                        f"{limits.max_total_bytes}")
    out: dict[str, torch.Tensor] = {}
    start = 0
    for spec in specs:
        out[spec.name] = decode_tensor(parts[start:start + spec.parts], spec, limits)
        start += spec.parts
    return out


# --- messages ---------------------------------------------------------------------------------

def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field_bytes(payload: int) -> int:
    """Bytes a length-delimited field with a one-byte tag and `payload` bytes adds to a message."""
    return 1 + _varint_len(payload) + payload


def to_messages(message_type: type[Message], metadata: bytes,
                parts: Sequence[runtime_pb2.Tensor], *, uid: str = "",
                chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                message_bytes: int = DEFAULT_MESSAGE_BYTES) -> list[Message]:
    """Spread parts over messages of at most `message_bytes` (ByteSize) each, every part cut into
    chunks of at most `chunk_bytes` of buffer. The first message carries `uid` (requests only)
    and `metadata`; there is always at least one message."""
    if not 0 < chunk_bytes < message_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"need 0 < chunk_bytes < message_bytes <= {MAX_MESSAGE_BYTES}, got "
                         f"chunk_bytes={chunk_bytes}, message_bytes={message_bytes}")
    if uid and message_type is not runtime_pb2.ExpertRequest:
        raise ValueError(f"{message_type.__name__} has no uid field, got uid={uid!r}")
    first = message_type(uid=uid, metadata=metadata) if uid else message_type(metadata=metadata)
    if first.ByteSize() > message_bytes:
        raise ValueError(f"metadata alone is {first.ByteSize()} bytes, over the "
                         f"{message_bytes}-byte message size")
    messages = [first]
    size = first.ByteSize()
    for part in parts:
        for chunk in split_for_streaming(part, chunk_bytes):
            added = _field_bytes(chunk.ByteSize())
            if size + added > message_bytes:
                messages.append(message_type())
                size = 0
            messages[-1].tensors.append(chunk)
            size += added
    return messages


def from_messages(messages: Sequence[Message]) -> tuple[str, bytes, list[runtime_pb2.Tensor]]:
    """(uid, metadata, parts) of a message sequence made by `to_messages`; uid is "" for
    responses. Only the first message may carry a uid or metadata."""
    if not messages:
        raise WireError("no messages")
    for index, message in enumerate(messages[1:], start=1):
        if message.metadata or getattr(message, "uid", ""):
            raise WireError(f"message {index} of {len(messages)}: only the first message may "
                            f"carry uid and metadata")
    chunks = [chunk for message in messages for chunk in message.tensors]
    parts: list[runtime_pb2.Tensor] = []
    index = 0
    while index < len(chunks):
        head = chunks[index]
        count = max(head.chunks, 1)  # an empty buffer is sent as one chunk that says 0
        if index + count > len(chunks):
            raise WireError(f"part {len(parts)} says {count} chunks, only "
                            f"{len(chunks) - index} chunks are left")
        tail = chunks[index + 1:index + count]
        for chunk in tail:
            if chunk.dtype or chunk.size or chunk.chunks or chunk.compression != _NONE:
                raise WireError(f"part {len(parts)}: a continuation chunk carries a header; "
                                f"the chunk count is wrong")
        parts.append(combine_from_streaming([head, *tail]))
        index += count
    return getattr(messages[0], "uid", ""), messages[0].metadata, parts


def message_bytes(messages: Sequence[Message]) -> int:
    """Serialized size of the messages, for byte accounting."""
    return sum(message.ByteSize() for message in messages)

"""Compressed weight updates: sparse, quantized deltas with error feedback, and dense keyframes.

A publisher (a stage's training peer) keeps the exact state it has published, `PublishedState`.
An update is the difference between its current weights and that state, compressed: per tensor the
`density` fraction of entries that moved most (top-k by magnitude), their values quantized to int8
in blocks of `QUANT_BLOCK` with one float32 scale each. The published state then advances by
exactly what was sent (the publisher applies its own payload with the same code a replica runs),
so whatever was not sent, the entries left out and the quantization error, stays in the next
difference: error feedback, and nothing is lost over time.

Replicas serve bf16 (each entry the cast of its published float32 value), and at RL learning
rates most entries move by far less than a bf16 step: a change that leaves an entry's bf16 value
where it was changes nothing the replicas serve. So entries are picked (`sync.selection`) by
magnitude, or only among those whose served bf16 value differs from the learner's, those that
moved most first; and sent (`sync.values`) as int8 deltas (above), or as the learner's bf16 value
itself, which the published state takes exactly (the replicas then serve exactly the learner's
bf16 value there). `served_fidelity` measures how far what is served is from the learner.

Bit-exactness: a replica and its publisher hold the published state in float32 on the CPU and
apply a payload with the same elementwise float32 operations (int8 times scale, then one add at
unique indices; or, for bf16 values, one exact assignment), which IEEE 754 rounds the same way on
every machine. `state_hash` over the
tensors' bytes then proves two peers hold the same state.

A keyframe is the dense published state itself: late joiners and peers that fell off the chain
of deltas start from it.

Payload bytes are msgpack of strict msgspec structs; `decode_payload` checks every field against
the state it is meant for before anything is applied."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import torch

from decentrl.net.protocol import ServedFidelity
from decentrl.net.wire import WireError, decode_struct, encode_struct

QUANT_BLOCK = 256  # selected values per int8 scale: 4 bytes of scale per 256 values
QUANT_LEVELS = 127
SERVED_DTYPE = torch.bfloat16  # what `selection="served_changes"` and the fidelity measure cast to
# Entries sampled to find a large tensor's top-k cut-off.
THRESHOLD_SAMPLE = 2**16
UpdateKind = Literal["delta", "keyframe"]
Selection = Literal["magnitude", "served_changes"]
ValueFormat = Literal["int8_delta", "bf16_value"]


class SparseTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The sent part of one tensor's delta: sorted flat indices (as LEB128 varints of the gaps)
    and, by `format`, int8 deltas with float32 scales (one per block of values), or the new
    values as bf16 bits (little-endian uint16, no scales)."""

    name: str
    count: int
    index_gaps: bytes
    values: bytes
    scales: bytes
    format: ValueFormat = "int8_delta"


class DenseTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    shape: list[int]
    data: bytes  # float32, little endian


class UpdatePayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: UpdateKind
    sparse: list[SparseTensor] = []
    dense: list[DenseTensor] = []


# ---- the published state ---------------------------------------------------------------------

def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, shape and float32 bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" \
                or not tensor.is_contiguous():
            raise ValueError(f"published tensor {name} must be contiguous float32 on the CPU, got "
                             f"{tensor.dtype} on {tensor.device}")
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(memoryview(tensor.numpy()).cast("B"))
    return digest.hexdigest()


def cpu_float32_copy(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private contiguous float32 CPU copies (the trainer keeps stepping its own tensors)."""
    return {name: t.detach().to("cpu", torch.float32, copy=True).contiguous()
            for name, t in tensors.items()}


@dataclass
class PublishedState:
    """The exact weights replicas of a stage hold at `version` (float32, CPU), and their hash."""

    version: int
    tensors: dict[str, torch.Tensor]
    hash: str

    @classmethod
    def of(cls, version: int, tensors: Mapping[str, torch.Tensor]) -> PublishedState:
        return cls.owning(version, cpu_float32_copy(tensors))

    @classmethod
    def owning(cls, version: int, tensors: dict[str, torch.Tensor]) -> PublishedState:
        """A state made of `tensors` themselves (contiguous float32 CPU tensors nobody else
        writes), without another copy."""
        return cls(version, tensors, state_hash(tensors))

    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def served_fidelity(learner: Mapping[str, torch.Tensor], published: PublishedState,
                    start: Mapping[str, torch.Tensor]) -> ServedFidelity:
    """How far the served weights (the bf16 cast of `published`) are from the `learner`'s
    (float32, CPU) bf16 cast, against the learner's movement since `start`, all in bf16: a
    replica serves bf16, so the learner's float32 bits below a bf16 step are not movement it
    could serve (and a bf16 value sent exactly leaves no gap)."""
    unserved = moved = 0.0
    differing = entries = 0
    for name, value in learner.items():
        target = value.to(SERVED_DTYPE).float()
        served = published.tensors[name].to(SERVED_DTYPE).float()
        unserved += float((target - served).pow(2).sum())
        moved += float((target - start[name].to(SERVED_DTYPE).float()).pow(2).sum())
        differing += int((target != served).sum())
        entries += value.numel()
    return ServedFidelity(unserved_square=unserved, moved_square=moved, differing=differing,
                          entries=entries)


# ---- varints ------------------------------------------------------------------------------------

def encode_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 (7 bits a byte, high bit: more bytes follow), vectorized."""
    v = values.astype(np.uint64)
    lengths = np.ones(v.shape, dtype=np.int64)
    for bits in (7, 14, 21, 28, 35, 42, 49, 56):
        lengths += v >= np.uint64(1 << bits)
    starts = np.zeros_like(lengths)
    np.cumsum(lengths[:-1], out=starts[1:])
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for j in range(int(lengths.max(initial=0))):
        has = lengths > j
        group = (v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[has] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + j] = (group | more).astype(np.uint8)
    return out.tobytes()


def decode_varints(data: bytes, count: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero((raw & 0x80) == 0)
    if len(ends) != count or (len(raw) and (not len(ends) or ends[-1] != len(raw) - 1)):
        raise WireError(f"index data holds {len(ends)} complete varints and "
                        f"{len(raw) - (ends[-1] + 1 if len(ends) else 0)} trailing bytes, "
                        f"expected {count} varints")
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if len(lengths) and lengths.max() > 9:
        raise WireError("index varint longer than 9 bytes")
    values = np.zeros(count, dtype=np.uint64)
    for j in range(int(lengths.max(initial=0))):
        has = lengths > j
        values[has] |= (raw[starts[has] + j].astype(np.uint64) & np.uint64(0x7F)) \
            << np.uint64(7 * j)
    return values


# ---- encoding ---------------------------------------------------------------------------------

def select_top(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Sorted flat indices of about the `density` fraction of entries largest in magnitude (at
    least one), skipping exact zeros: nothing to send there. A large tensor's cut-off comes from a
    fixed sample of its entries (an exact top-k of tens of millions of entries costs seconds of
    CPU per update); error feedback makes up for a few entries more or less."""
    magnitude = delta.reshape(-1).abs()
    k = max(1, math.ceil(density * magnitude.numel()))
    if k >= magnitude.numel():
        indices = torch.arange(magnitude.numel())
    elif magnitude.numel() <= THRESHOLD_SAMPLE:
        indices = torch.topk(magnitude, k, sorted=False).indices
    else:
        sample = magnitude[torch.randint(magnitude.numel(), (THRESHOLD_SAMPLE,),
                                         generator=torch.Generator().manual_seed(magnitude.numel()))]
        cut = torch.topk(sample, max(1, round(density * THRESHOLD_SAMPLE))).values[-1]
        indices = torch.nonzero(magnitude >= cut).reshape(-1)
        if indices.numel() > 2 * k:
            # Ties at the cut-off (Adam's first step moves nearly every entry by exactly the
            # learning rate): take the exact top k instead of all of them.
            indices = torch.topk(magnitude, k, sorted=False).indices
    return torch.sort(indices[magnitude[indices] != 0]).values


def select_served_changes(published: torch.Tensor, current: torch.Tensor, density: float
                          ) -> torch.Tensor:
    """Sorted flat indices of the entries whose served (bf16) value would change if the published
    value became the learner's, at most the `density` fraction of the tensor (rounded up): those
    that moved most. An entry whose movement stays within its bf16 step is never picked: sending
    it would change nothing the replicas serve, and error feedback keeps it until it does."""
    published, current = published.reshape(-1), current.reshape(-1)
    candidates = torch.nonzero(current.to(SERVED_DTYPE) != published.to(SERVED_DTYPE)).reshape(-1)
    k = max(1, math.ceil(density * current.numel()))
    if candidates.numel() > k:
        movement = (current[candidates] - published[candidates]).abs()
        candidates = candidates[torch.topk(movement, k, sorted=False).indices]
    return torch.sort(candidates).values


def bf16_bits(values: torch.Tensor) -> bytes:
    """float32 values rounded to bf16 (to nearest even, as a cast is), as little-endian uint16."""
    bits = values.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2")
    return bits.tobytes()


def bf16_values(data: bytes) -> torch.Tensor:
    """The float32 values of bf16 bits (little-endian uint16): exact, a bf16 is a float32 with
    the low 16 bits zero."""
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return torch.from_numpy(bits.view(np.float32).copy())


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and one float32 scale per block of QUANT_BLOCK values (absmax / 127)."""
    blocks = math.ceil(values.numel() / QUANT_BLOCK)
    padded = torch.zeros(blocks * QUANT_BLOCK, dtype=torch.float32)
    padded[:values.numel()] = values
    padded = padded.view(blocks, QUANT_BLOCK)
    scales = padded.abs().amax(dim=1) / QUANT_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-QUANT_LEVELS, QUANT_LEVELS)
    return codes.to(torch.int8).reshape(-1)[:values.numel()], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    per_value = scales.repeat_interleave(QUANT_BLOCK)[:codes.numel()]
    return codes.to(torch.float32) * per_value


def encode_delta(published: PublishedState, current: Mapping[str, torch.Tensor],
                 density: float, selection: Selection = "magnitude",
                 values: ValueFormat = "int8_delta") -> UpdatePayload:
    """The compressed difference `current - published` (the published state is not changed):
    entries picked by `selection`, sent as `values`."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if set(current) != set(published.tensors):
        raise ValueError(f"current weights {sorted(set(current) ^ set(published.tensors))[:3]} "
                         "do not match the published state")
    sparse = []
    for name in sorted(published.tensors):
        base = published.tensors[name]
        value = current[name].detach().to("cpu", torch.float32)
        if value.shape != base.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, published "
                             f"{tuple(base.shape)}")
        delta = (value - base).reshape(-1)
        indices = select_top(delta, density) if selection == "magnitude" \
            else select_served_changes(base, value, density)
        if indices.numel() == 0:
            continue
        gaps = encode_varints(np.diff(indices.numpy(), prepend=-1) - 1)
        if values == "bf16_value":
            sparse.append(SparseTensor(name=name, count=indices.numel(), index_gaps=gaps,
                                       values=bf16_bits(value.reshape(-1)[indices]), scales=b"",
                                       format="bf16_value"))
            continue
        codes, scales = quantize(delta[indices])
        sparse.append(SparseTensor(name=name, count=indices.numel(), index_gaps=gaps,
                                   values=codes.numpy().tobytes(),
                                   scales=scales.numpy().astype("<f4").tobytes()))
    return UpdatePayload(kind="delta", sparse=sparse)


def encode_keyframe(published: PublishedState) -> UpdatePayload:
    return UpdatePayload(kind="keyframe", dense=[
        DenseTensor(name=name, shape=list(t.shape), data=t.numpy().astype("<f4").tobytes())
        for name, t in sorted(published.tensors.items())])


def payload_bytes(payload: UpdatePayload) -> bytes:
    return encode_struct(payload)


# ---- decoding and applying ------------------------------------------------------------------

@dataclass
class TensorChange:
    """What one update did to one tensor: where (flat indices; None: every entry, a keyframe),
    the new values, and the old ones (undo)."""

    indices: torch.Tensor | None
    values: torch.Tensor
    old: torch.Tensor

    def write(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` (new or old, flat) at this change's entries of `tensor`, on its device
        and in its dtype."""
        flat = tensor.view(-1)
        values = values.to(flat.device, flat.dtype)
        if self.indices is None:
            flat.copy_(values)
        else:
            flat[self.indices.to(flat.device)] = values


def decode_payload(data: bytes | bytearray, shapes: Mapping[str, torch.Size]
                   ) -> UpdatePayload:
    """A payload checked against the state it will be applied to (`shapes`: name -> shape)."""
    payload = decode_struct(data, UpdatePayload)
    if payload.kind == "keyframe":
        names = [t.name for t in payload.dense]
        if payload.sparse or sorted(names) != sorted(shapes) or len(set(names)) != len(names):
            raise WireError(f"keyframe tensors {sorted(set(names) ^ set(shapes))[:3]} do not "
                            "match the stage's")
        for tensor in payload.dense:
            expected = shapes[tensor.name]
            if tuple(tensor.shape) != tuple(expected) \
                    or len(tensor.data) != 4 * math.prod(expected):
                raise WireError(f"keyframe tensor {tensor.name}: shape {tensor.shape} with "
                                f"{len(tensor.data)} bytes, the stage needs {tuple(expected)}")
        return payload
    if payload.dense:
        raise WireError("a delta carries no dense tensors")
    seen = set()
    for tensor in payload.sparse:
        if tensor.name not in shapes or tensor.name in seen:
            raise WireError(f"delta for unknown or repeated tensor {tensor.name!r}")
        seen.add(tensor.name)
        numel = math.prod(shapes[tensor.name])
        # int8 deltas: a byte a value and a float32 scale a block; bf16 values: two bytes each.
        value_bytes, scale_bytes = (tensor.count, 4 * math.ceil(tensor.count / QUANT_BLOCK)) \
            if tensor.format == "int8_delta" else (2 * tensor.count, 0)
        if not 0 < tensor.count <= numel or len(tensor.values) != value_bytes \
                or len(tensor.scales) != scale_bytes:
            raise WireError(f"delta for {tensor.name} ({tensor.format}): {tensor.count} entries "
                            f"with {len(tensor.values)} value bytes and {len(tensor.scales)} "
                            f"scale bytes, expected {value_bytes} and {scale_bytes} (the tensor "
                            f"has {numel} entries)")
    return payload


def _sparse_change(tensor: SparseTensor, state: torch.Tensor) -> TensorChange:
    gaps = decode_varints(tensor.index_gaps, tensor.count)
    out_of_range = WireError(f"delta for {tensor.name}: index out of range of its "
                             f"{state.numel()} entries")
    # Gaps are checked before they are summed, so a forged huge gap cannot wrap around.
    if gaps.max() >= state.numel():
        raise out_of_range
    positions = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    if positions[-1] >= state.numel():
        raise out_of_range
    indices = torch.from_numpy(positions.astype(np.int64))
    flat = state.view(-1)
    old = flat[indices].clone()
    if tensor.format == "bf16_value":
        return TensorChange(indices, bf16_values(tensor.values), old)
    scales = torch.from_numpy(np.frombuffer(tensor.scales, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError(f"delta for {tensor.name}: scales must be finite and >= 0")
    codes = torch.from_numpy(np.frombuffer(tensor.values, dtype=np.int8).copy())
    return TensorChange(indices, old + dequantize(codes, scales), old)


def apply_payload(state: PublishedState, payload: UpdatePayload, version: int
                  ) -> dict[str, TensorChange]:
    """Apply a decoded payload to `state` in place (new version; the hash is the caller's to
    recompute and check). Returns what changed, so a replica can copy just those entries into its
    model and undo them if the hash disagrees. Every tensor is checked before any is changed."""
    changes: dict[str, TensorChange] = {}
    if payload.kind == "keyframe":
        for dense in payload.dense:
            values = torch.from_numpy(np.frombuffer(dense.data, dtype="<f4").astype(np.float32))
            if not bool(torch.isfinite(values).all()):
                raise WireError(f"keyframe tensor {dense.name} has non-finite values")
            changes[dense.name] = TensorChange(None, values,
                                               state.tensors[dense.name].reshape(-1).clone())
    else:
        for sparse in payload.sparse:
            change = _sparse_change(sparse, state.tensors[sparse.name])
            if not bool(torch.isfinite(change.values).all()):
                raise WireError(f"delta for {sparse.name} makes non-finite weights")
            changes[sparse.name] = change
    for name, change in changes.items():
        change.write(state.tensors[name], change.values)
    state.version = version
    return changes


def undo_changes(state: PublishedState, changes: Mapping[str, TensorChange], version: int,
                 hash_: str) -> None:
    """Put back what `apply_payload` changed (the state it was applied to had `version` and
    `hash_`)."""
    for name, change in changes.items():
        change.write(state.tensors[name], change.old)
    state.version, state.hash = version, hash_

"""A mixture of experts' recorded routing as a rollout carries it (rollout/types.py
RoutingRecord), to and from the tensors the stages return and replay (model/stages.py
`Routed.experts`: [tokens, sparse layers, top_k] per row)."""

from __future__ import annotations

import torch

from decentrl.rollout.types import ROUTING_ITEMSIZE, RoutingRecord

ROUTING_DTYPES = {"int8": torch.int8, "int16": torch.int16}


def routing_record(experts: torch.Tensor) -> RoutingRecord:
    """The record of one row's experts [tokens, layers, top_k] (int8 or int16)."""
    names = {dtype: name for name, dtype in ROUTING_DTYPES.items()}
    if experts.dim() != 3 or experts.dtype not in names:
        raise ValueError(f"a routing record is [tokens, layers, top_k] of int8 or int16, got "
                         f"{tuple(experts.shape)} {experts.dtype}")
    data = experts.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return RoutingRecord(layers=experts.shape[1], top_k=experts.shape[2],
                         dtype=names[experts.dtype], experts=data)


def routing_tensor(record: RoutingRecord) -> torch.Tensor:
    """The experts [tokens, layers, top_k] of a checked record (RoutingRecord.check)."""
    dtype = ROUTING_DTYPES[record.dtype]
    per_token = record.layers * record.top_k * ROUTING_ITEMSIZE[record.dtype]
    if not record.experts:
        return torch.empty((0, record.layers, record.top_k), dtype=dtype)
    flat = torch.frombuffer(bytearray(record.experts), dtype=dtype)
    return flat.reshape(len(record.experts) // per_token, record.layers, record.top_k)

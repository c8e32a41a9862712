"""The table of RPCs (net/protocol.py): every RPC declared once, and the checks its declaration
makes before a handler runs or a reply is used. The refusals over the network are in
tests/test_swarm.py (BAD_REQUESTS)."""

from __future__ import annotations

import math
import typing

import msgspec
import pytest
import torch

from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    RPCS,
    SMALL_REQUEST_BYTES,
    SUBMIT_ROLLOUTS,
    TRAIN_AUDIT_LOAD,
    TRAIN_FORWARD,
    Callers,
    InferenceStep,
)
from decentrl.net.wire import WireError, decode_struct, encode_struct
from decentrl.rollout.sampling import SamplingConfig

STEP = {"inputs": torch.tensor([[1, 2]]), "positions": torch.tensor([[0, 1]]),
        "key_valid": torch.ones(1, 2, dtype=torch.bool)}


def test_every_rpc_is_declared_once_with_strict_bodies_and_known_callers() -> None:
    assert len(RPCS) == 17
    for method, rpc in RPCS.items():
        assert rpc.method == method
        assert rpc.callers in typing.get_args(Callers), method
        assert issubclass(rpc.request, msgspec.Struct) and issubclass(rpc.reply, msgspec.Struct)
        for body in (rpc.request, rpc.reply):
            assert body.__struct_config__.forbid_unknown_fields, f"{method}: {body.__name__}"
        # A request that carries no tensors is small; activations and batches are bounded by
        # the run's sizes.
        # (A stretch of a training state in an audit is bounded by the chunk it is cut in.)
        if rpc not in (SUBMIT_ROLLOUTS, TRAIN_AUDIT_LOAD):
            assert callable(rpc.max_bytes) == bool(rpc.tensors), method
            assert callable(rpc.max_bytes) or rpc.max_bytes == SMALL_REQUEST_BYTES, method


def test_a_request_carries_exactly_the_tensors_its_rpc_takes() -> None:
    INFERENCE_STEP.check_tensors(STEP)  # token ids at stage 0
    INFERENCE_STEP.check_tensors({**STEP, "inputs": torch.randn(1, 2, 8)})  # hidden states
    with pytest.raises(WireError, match=r"inference_step takes no tensors \['extra'\]"):
        INFERENCE_STEP.check_tensors({**STEP, "extra": torch.zeros(1)})
    with pytest.raises(WireError, match=r"inference_step needs tensors \['key_valid'\]"):
        INFERENCE_STEP.check_tensors({k: v for k, v in STEP.items() if k != "key_valid"})
    with pytest.raises(WireError, match="tensor positions must be int64, got torch.float32"):
        INFERENCE_STEP.check_tensors({**STEP, "positions": torch.zeros(1, 2)})
    with pytest.raises(WireError, match="tensor inputs must be ids or float, got torch.bool"):
        INFERENCE_STEP.check_tensors({**STEP, "inputs": torch.ones(1, 2, dtype=torch.bool)})
    with pytest.raises(WireError, match=r"close_session takes no tensors \['inputs'\]"):
        CLOSE_SESSION.check_tensors({"inputs": torch.zeros(1)})
    # Optional tensors may be left out; required ones may not.
    with pytest.raises(WireError, match=r"train_forward needs tensors \['advantages'"):
        TRAIN_FORWARD.check_tensors({"prompts": torch.ones(1, 2, dtype=torch.long)})


def test_a_reply_carries_only_the_tensors_its_rpc_replies_with() -> None:
    INFERENCE_STEP.check_reply_tensors({"tokens": torch.zeros(1, dtype=torch.long)})
    with pytest.raises(WireError, match=r"a close_session reply carries no tensors \['data'\]"):
        CLOSE_SESSION.check_reply_tensors({"data": torch.zeros(1)})


@pytest.mark.parametrize(("sampling", "message"), [
    ({"temperature": math.nan}, "temperature must be finite and >= 0, got nan"),
    ({"temperature": -1.0}, "temperature must be finite and >= 0, got -1.0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_k": -3}, "top_k must be >= 0, got -3"),
    ({"seed": 3}, "unknown field `seed`"),
])
def test_sampling_parameters_are_checked_as_they_are_decoded(sampling: dict[str, object],
                                                              message: str) -> None:
    body = {"session": "s", "start": 0, "batch": 1, "max_length": 4, "sampling": sampling}
    with pytest.raises(WireError, match=f"bad InferenceStep message: .*{message}"):
        decode_struct(encode_struct(body), InferenceStep)
    valid = InferenceStep(session="s", start=0, batch=1, max_length=4,
                          sampling=SamplingConfig(0.7, 0.9, 40))
    assert decode_struct(encode_struct(valid), InferenceStep) == valid

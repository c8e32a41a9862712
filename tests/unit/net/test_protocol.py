"""The table of RPCs (net/protocol.py): every RPC declared once, and the checks its declaration
makes before a handler runs or a reply is used. The refusals over the network are in
tests/swarm/test_swarm.py (BAD_REQUESTS)."""

from __future__ import annotations

import hashlib
import math
import typing

import msgspec
import pytest
import torch

from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    RPCS,
    SUBMIT_ROLLOUTS,
    TRAIN_AUDIT_LOAD,
    TRAIN_FORWARD,
    TRAIN_LOGPROBS,
    TRAIN_LOGPROBS_CHAIN,
    Callers,
    InferenceStep,
)
from decentrl.net.sizes import SMALL_REQUEST_BYTES, RunSizes, forward_request_bytes
from decentrl.net.wire import (
    TensorLimits,
    WireError,
    decode_struct,
    decode_tensors,
    encode_struct,
    encode_tensors,
)
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout

STEP = {"inputs": torch.tensor([[1, 2]]), "positions": torch.tensor([[0, 1]]),
        "key_valid": torch.ones(1, 2, dtype=torch.bool)}


def test_every_rpc_is_declared_once_with_strict_bodies_and_known_callers() -> None:
    assert len(RPCS) == 26
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


def test_a_forward_only_pass_takes_no_loss_inputs() -> None:
    """train_logprobs and train_logprobs_chain compute no loss: a proximal or reference tensor
    is refused unread, as any tensor the RPC does not declare."""
    batch = {name: torch.zeros(1, dtype=torch.long) for name in TRAIN_LOGPROBS.tensors}
    for rpc in (TRAIN_LOGPROBS, TRAIN_LOGPROBS_CHAIN):
        assert "proximal" not in rpc.tensors and "reference" not in rpc.tensors
        with pytest.raises(WireError, match=r"takes no tensors \['proximal'\]"):
            rpc.check_tensors({**batch, "proximal": torch.zeros(1)})
    TRAIN_LOGPROBS_CHAIN.check_reply_tensors({"logprobs": torch.zeros(1)})
    with pytest.raises(WireError, match=r"carries no tensors \['prompt_grad'\]"):
        TRAIN_LOGPROBS_CHAIN.check_reply_tensors({"prompt_grad": torch.zeros(1)})


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


# ---- a training micro-batch on the wire --------------------------------------------------------
#
# TrainBatch's fields are declared once (learn/batch.py); what the coordinator sends for them, and
# the size limit of a training forward, must stay what they were when each RPC listed them itself.

# The digest of this batch as c9d6e03 sent it (swarm/training_client.py encoded BATCH_TENSORS).
PINNED_BATCH_SHA256 = "67a6c48325510e0913798cef3b1934f87c02d89d8abe725cb721174d144066a2"
# What train_forward took when it listed the batch's fields itself: (dtype kind, required).
PINNED_FORWARD_TENSORS = {
    "prompts": ("int64", True), "prompt_valid": ("bool", True),
    "prompt_positions": ("int64", True), "completions": ("int64", True),
    "completion_valid": ("bool", True), "completion_generated": ("bool", True),
    "completion_positions": ("int64", True), "prompt_of": ("int64", True),
    "behaviour_logprobs": ("float32", True), "advantages": ("float32", True),
    "staleness": ("int64", True), "supervised": ("bool", True),
    "prompt_in": ("ids or float", True), "completion_in": ("ids or float", True),
    "proximal": ("float32", False), "reference": ("float32", False),
    "routing": ("experts", False),
    # Since entropy control (learn/entropy.py): the tokens its method acts on, a byte each.
    "selected": ("bool", False)}
# Its size limit then, for two runs' sizes (the former formula, evaluated by hand), with the byte
# per completion position `selected` added (8 x 128 and 32 x 4096 positions) and its 1/1024 of
# frame headers.
PINNED_FORWARD_BYTES = [638_679 + 1024 + 1, 2_155_813_408 + 131_072 + 128]


def pinned_batch() -> TrainBatch:
    """Two samples of one prompt, one of another (with a fed-in token), and a demonstration."""
    rollouts = [Rollout(prompt_tokens=[5, 6, 7], completion_tokens=[8, 3],
                        behaviour_logprobs=[-0.125, -0.25], finished=True),
                Rollout(prompt_tokens=[1], completion_tokens=[2, 3, 4],
                        behaviour_logprobs=[-0.5, 0.0, -0.75], finished=False,
                        generated=[True, False, True]),
                Rollout(prompt_tokens=[5, 6, 7], completion_tokens=[4],
                        behaviour_logprobs=[-1.5], finished=True)]
    demonstration = Rollout(prompt_tokens=[1, 2], completion_tokens=[9, 9],
                            behaviour_logprobs=[0.0, 0.0], finished=True)
    return build_batch(rollouts, [0.5, -0.5, 0.25], [0, 2, 1], 0, [demonstration])


def test_a_train_batch_goes_on_the_wire_as_it_did() -> None:
    batch = pinned_batch()
    parts, manifest = encode_tensors(batch.tensors(), "fp32")
    digest = hashlib.sha256(encode_struct(manifest))
    for part in parts:
        digest.update(part.SerializeToString())
    assert digest.hexdigest() == PINNED_BATCH_SHA256
    # What the stage peer rebuilds from them is the batch that was sent.
    decoded = TrainBatch.from_tensors(decode_tensors(parts, manifest, TensorLimits()))
    assert all(torch.equal(decoded.tensors()[name], tensor)
               for name, tensor in batch.tensors().items())


def test_a_training_forward_takes_the_tensors_and_bytes_it_did() -> None:
    kinds = {name: (rule.kind, rule.required) for name, rule in TRAIN_FORWARD.tensors.items()}
    assert list(kinds.items()) == list(PINNED_FORWARD_TENSORS.items())  # the order is the wire's
    sizes = [RunSizes(64, 128, 4096, 8), RunSizes(2048, 4096, 65536, 32)]
    assert [forward_request_bytes(s) for s in sizes] == PINNED_FORWARD_BYTES
    # A mixture of experts' routing adds its bytes at every completion position.
    routed = RunSizes(64, 128, 4096, 8, routing_bytes=12)
    assert forward_request_bytes(routed) - forward_request_bytes(sizes[0]) >= 8 * 128 * 12

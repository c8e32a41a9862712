"""Evidence of a malformed push (net/evidence.py) and what the coordinator makes of it
(trust/evidence.py): proof only of content the accused signed, bounded as it is kept."""

from __future__ import annotations

from pathlib import Path

import torch
from hivemind.proto import runtime_pb2

from decentrl.model.loading import model_spec
from decentrl.model.spec import ModelSpec
from decentrl.net.evidence import MAX_ITEMS, MAX_PER_SENDER, EvidenceLocker, SignedCopy
from decentrl.net.guard import encode_mixed
from decentrl.net.identity import Identity
from decentrl.net.protocol import INFERENCE_PUSH
from decentrl.net.push_messages import PushStep
from decentrl.net.signing import signed_envelope
from decentrl.net.wire import encode_struct
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inbound import InboundChecks
from decentrl.trust.evidence import ContentCheck, proven_fault

PUSH = PushStep(route=b"", start=0, fresh=1, session="s", commits=[],
                sampling=SamplingConfig(temperature=0.0), seed=None)


def signed_push(identity: Identity, hidden: torch.Tensor, request_id: str = "r1"
                ) -> tuple[bytes, list[runtime_pb2.Tensor]]:
    tensors = {"inputs": hidden, "positions": torch.zeros(1, hidden.shape[1], dtype=torch.long),
               "key_valid": torch.ones(1, hidden.shape[1], dtype=torch.bool)}
    parts, manifest = encode_mixed(tensors, "fp32", None)
    return signed_envelope(identity, "request", INFERENCE_PUSH.method, request_id,
                           encode_struct(PUSH), manifest, parts), parts


def copy_of(envelope: bytes, parts: list[runtime_pb2.Tensor], request_id: str = "r1"
            ) -> SignedCopy:
    return SignedCopy(INFERENCE_PUSH.method, request_id, envelope,
                      [p.SerializeToString() for p in parts], "refused")


def check_for(spec: ModelSpec) -> ContentCheck:
    checks = InboundChecks(spec, 1, 2, 4096)
    return lambda tensors: checks.pushed_inputs(tensors["inputs"])


def test_only_content_the_accused_signed_and_that_fails_is_proof(tiny_model_dir: Path) -> None:
    spec = model_spec(tiny_model_dir)
    check = check_for(spec)
    liar, other = Identity.generate(), Identity.generate()
    narrow = copy_of(*signed_push(liar, torch.randn(1, 3, spec.hidden_size // 2)))
    assert "stage 1 takes hidden states" in str(proven_fault(narrow, liar.peer_id,
                                                             INFERENCE_PUSH, check))
    huge = copy_of(*signed_push(liar, torch.full((1, 3, spec.hidden_size), 1e30)))
    assert "over the bound" in str(proven_fault(huge, liar.peer_id, INFERENCE_PUSH, check))
    # The same bytes are no proof against anyone who did not sign them...
    assert proven_fault(narrow, other.peer_id, INFERENCE_PUSH, check) is None
    # ...nor is an honest push, nor one whose parts were swapped after signing.
    honest = copy_of(*signed_push(liar, torch.randn(1, 3, spec.hidden_size)))
    assert proven_fault(honest, liar.peer_id, INFERENCE_PUSH, check) is None
    forged = SignedCopy(narrow.method, narrow.request_id, narrow.envelope, honest.parts, "x")
    assert proven_fault(forged, liar.peer_id, INFERENCE_PUSH, check) is None
    junk = SignedCopy(narrow.method, narrow.request_id, b"\x00junk", [b"\xff"], "x")
    assert proven_fault(junk, liar.peer_id, INFERENCE_PUSH, check) is None


def test_the_locker_keeps_a_few_per_sender_and_forgets_in_time() -> None:
    now = [0.0]
    locker = EvidenceLocker(clock=lambda: now[0])
    liar = Identity.generate()
    envelope, parts = signed_push(liar, torch.randn(1, 2, 8))
    for number in range(5):
        locker.keep("a", "inference_push", f"r{number}", envelope, parts, "refused")
    kept = locker.copies("a", "inference_push")
    assert [c.request_id for c in kept] == [f"r{n}" for n in range(5 - MAX_PER_SENDER, 5)]
    for sender in range(MAX_ITEMS + 3):  # many keys: the oldest go first, the total holds
        locker.keep(f"s{sender}", "inference_push", "r", envelope, parts, "refused")
    assert locker.copies("a", "inference_push") == []
    assert len(locker.copies(f"s{MAX_ITEMS + 2}", "inference_push")) == 1
    now[0] = 10_000.0
    assert locker.copies(f"s{MAX_ITEMS + 2}", "inference_push") == []

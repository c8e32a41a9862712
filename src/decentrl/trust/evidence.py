"""The coordinator's reading of a receiver's evidence (net/evidence.py): is a push that stage k
signed, and stage k+1 refused, proof against k?

It is when the signature is k's and the content fails a check that needs nothing but the push
itself and the model's shape: a body or tensors that do not decode, tensors the RPC does not
take, inputs that are not the stage's kind (hidden states of the wrong width), non-finite values
or values over the bound no honest activation reaches (trust/relay.py). What depends on the
receiver's own state (a session it does not hold, its limits, its load) proves nothing, and is
not judged here: such a refusal only moves the session, as before. Tensors are decoded under
limits far above any peer's, so that a size a receiver chose to refuse is never taken for a
fault."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from decentrl.errors import SenderFault
from decentrl.net.evidence import SignedCopy
from decentrl.net.protocol import Rpc
from decentrl.net.signing import Envelope, verify_envelope
from decentrl.net.wire import TensorLimits, WireError, decode_struct, decode_tensors

# Generous: only content, never size, decides.
EVIDENCE_LIMITS = TensorLimits(max_elements_per_tensor=2**34, max_total_bytes=2**40)

ContentCheck = Callable[[dict[str, torch.Tensor]], None]


def proven_fault(copy: SignedCopy, accused: str, rpc: Rpc[Any, Any], check: ContentCheck
                 ) -> str | None:
    """Why `copy` proves that `accused` sent `rpc` content no honest peer sends (`check` raises
    a SenderFault on the RPC's own content checks), or None: not signed by `accused`, not of
    `rpc`, or content that passes."""
    if copy.method != rpc.method:
        return None
    try:
        envelope = decode_struct(copy.envelope, Envelope)
        parts = [runtime_pb2.Tensor.FromString(part) for part in copy.parts]
        verify_envelope(accused, "request", copy.method, copy.request_id, envelope, parts)
    except (WireError, ValueError):  # protobuf's DecodeError is a ValueError
        return None  # not the accused's signed words: proves nothing against it
    try:
        decode_struct(envelope.body, rpc.request)
        tensors = decode_tensors(parts, envelope.manifest, EVIDENCE_LIMITS)
        rpc.check_tensors(tensors)
        check(tensors)
    except SenderFault as fault:
        return f"pushed {rpc.method} content it signed that fails a check: {fault}"
    return None

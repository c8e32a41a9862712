"""The wrapper around every handler a node serves, and around every call it makes (as hivemind's
`AuthRPCWrapper` wraps a servicer and a stub): who may call, the sender's signature, the size and
shape of what comes in, and the signature on what goes out.

Served: `Guard.wrap(rpc, handler)` is a `Guarded` handler. Before any of a request is read, its
sender must pass the node's callers policy (`Guard.authorize`, net/authority.py: the RPC's
`callers` rule); the request is then opened only if its sender signed it (net/signing.py), and
its body must decode as the RPC's request and its tensors be the ones the RPC takes before the
handler runs; the reply is signed. Every refusal on the way is a `SenderFault` (a strike, net/
serving.py) but for a caller the policy does not know yet (`CallerUnknown`).

Called: `Guard.signed_request` signs a request; `Guard.open_reply` checks that the reply is the
peer's signed answer to that very request before its tensors are decoded, and `Guard.reply_of`
that its tensors and body are what the RPC replies with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from hivemind.proto import runtime_pb2

from decentrl.errors import SenderFault
from decentrl.net.authority import CallerPolicy, only_any_peer
from decentrl.net.evidence import EvidenceLocker
from decentrl.net.identity import Identity
from decentrl.net.protocol import Rpc
from decentrl.net.signing import Envelope, signed_envelope, verify_envelope
from decentrl.net.sizes import RunSizes, size_limit
from decentrl.net.wire import (
    ActivationCodec,
    TensorLimits,
    TensorManifest,
    WireError,
    decode_struct,
    decode_tensors,
    encode_struct,
    encode_tensors,
    from_messages,
    to_messages,
)

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class ReplyContentError(WireError):
    """A reply its sender signed whose content breaks the protocol (non-finite values, tensors
    over the limits or that its RPC never replies with, a body that does not decode): the
    sender's own doing, not the transport's, so proof against it."""


@dataclass
class Request(Generic[Req]):
    """What a handler receives: the body decoded as its RPC's request, the tensors (checked
    against the RPC's declaration), and who sent them."""

    body: Req
    tensors: dict[str, torch.Tensor]
    sender: str
    address: str = ""  # the multiaddr the sender's stream came from (a relay's, if relayed)


@dataclass
class Reply:
    body: Any = None  # a msgspec struct, encoded by the node
    tensors: Mapping[str, torch.Tensor] | None = None
    codec: ActivationCodec = "fp32"
    exact: Mapping[str, torch.Tensor] | None = None  # tensors sent in full precision
    # Tensors already encoded (encode_tensors' parts and manifest): a large reply served many
    # times (a stage's weights) is encoded once, not once per request.
    encoded: tuple[list[runtime_pb2.Tensor], TensorManifest] | None = None


Handler = Callable[[Request[Req]], Awaitable[Reply]]


def encode_mixed(tensors: Mapping[str, torch.Tensor] | None, codec: ActivationCodec,
                 exact: Mapping[str, torch.Tensor] | None
                 ) -> tuple[list[runtime_pb2.Tensor], TensorManifest]:
    """A message's tensors: `tensors` with `codec` (activations), `exact` in full precision
    (scores, log-probs)."""
    parts, manifest = encode_tensors(dict(tensors or {}), codec)
    if exact:
        exact_parts, exact_manifest = encode_tensors(dict(exact), "fp32")
        parts = [*parts, *exact_parts]
        manifest = TensorManifest(tensors=manifest.tensors + exact_manifest.tensors)
    return parts, manifest


@dataclass(frozen=True)
class SignedRequest:
    """A request whose signature checked out; nothing past its envelope is decoded yet."""

    request_id: str
    envelope: Envelope
    parts: list[runtime_pb2.Tensor]


class Guard:
    """One node's checks and signatures: its key, its tensor limits, the run's sizes (which
    bound the activations and micro-batches its RPCs carry: needed to serve those RPCs; a
    caller without them caps such replies at `limits` alone) and its callers policy."""

    def __init__(self, identity: Identity, limits: TensorLimits) -> None:
        self.identity = identity
        self.limits = limits
        self.sizes: RunSizes | None = None
        self.authorize: CallerPolicy = only_any_peer
        # Pushes from the previous stage refused as their sender's fault, as they were signed
        # (net/evidence.py): the coordinator's proof against a stage that pushed them.
        self.evidence = EvidenceLocker()

    def wrap(self, rpc: Rpc[Req, Any], handler: Handler[Req]) -> Guarded[Req]:
        return Guarded(self, rpc, handler)

    def request_limit(self, rpc: Rpc[Any, Any]) -> int:
        """The most bytes a request of `rpc` may take on the wire here."""
        declared = size_limit(rpc.max_bytes, self.sizes)
        if declared is None:
            raise ValueError(f"{rpc.method}'s request limit depends on the run's sizes: set the "
                             f"node's sizes (RunSizes.of(spec, config)) before serving it")
        return min(declared, self.limits.max_total_bytes)

    def reply_limit(self, rpc: Rpc[Any, Any]) -> int:
        """The most bytes a reply of `rpc` may take on the wire here."""
        declared = size_limit(rpc.max_reply_bytes, self.sizes)
        return self.limits.max_total_bytes if declared is None \
            else min(declared, self.limits.max_total_bytes)

    # ---- the calling side ----------------------------------------------------------------

    def signed_request(self, rpc: Rpc[Req, Any], body: Req, request_id: str,
                       tensors: Mapping[str, torch.Tensor] | None, codec: ActivationCodec,
                       exact: Mapping[str, torch.Tensor] | None
                       ) -> list[runtime_pb2.ExpertRequest]:
        """The messages of a request: `tensors` go with `codec`, `exact` in full precision."""
        if not isinstance(body, rpc.request):
            raise TypeError(f"{rpc.method} takes a {rpc.request.__name__} body, not "
                            f"{type(body).__name__}")
        parts, manifest = encode_mixed(tensors, codec, exact)
        metadata = signed_envelope(self.identity, "request", rpc.method, request_id,
                                   encode_struct(body), manifest, parts)
        return to_messages(runtime_pb2.ExpertRequest, metadata, parts, uid=request_id)

    def open_reply(self, responses: list[Any], peer: str, method: str, request_id: str
                   ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The body and tensors of `peer`'s reply, checked to be its signed answer to this very
        request before its tensors are decoded."""
        _, metadata, parts = from_messages(responses)
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(peer, "reply", method, request_id, envelope, parts)
        try:
            return envelope.body, decode_tensors(parts, envelope.manifest, self.limits)
        except WireError as error:
            raise ReplyContentError(f"{method} at {peer[-8:]}: {error}") from None

    @staticmethod
    def reply_of(rpc: Rpc[Any, Rep], peer: str, body: bytes, tensors: dict[str, torch.Tensor]
                 ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """An opened reply as `rpc`'s reply; ReplyContentError unless it is one."""
        try:
            rpc.check_reply_tensors(tensors)
            return decode_struct(body, rpc.reply), tensors
        except WireError as error:
            raise ReplyContentError(f"{rpc.method} at {peer[-8:]}: {error}") from None


@dataclass(frozen=True)
class Guarded(Generic[Req]):
    """`handler` of `rpc` as its node serves it: the serving side of `Guard`."""

    guard: Guard
    rpc: Rpc[Req, Any]
    handler: Handler[Req]

    async def admit(self, sender: str) -> None:
        """Before any of a request is read: CallerRefused (a strike) or CallerUnknown (none)
        unless `sender` may call this RPC here."""
        await self.guard.authorize(sender, self.rpc)

    def open(self, sender: str, messages: list[Any]) -> SignedRequest:
        """The request in `messages`, which `sender` signed (else a WireError). Nothing is
        decoded past the envelope before the signature checks out."""
        request_id, metadata, parts = from_messages(messages)
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(sender, "request", self.rpc.method, request_id, envelope, parts)
        return SignedRequest(request_id, envelope, parts)

    async def answer(self, request: SignedRequest, sender: str, address: str
                     ) -> list[runtime_pb2.ExpertResponse]:
        """The handler's signed reply, once the body decodes as the RPC's request and the
        tensors are the ones it takes (else a WireError)."""
        rpc = self.rpc
        try:
            body = decode_struct(request.envelope.body, rpc.request)
            tensors = decode_tensors(request.parts, request.envelope.manifest,
                                     self.guard.limits)
            rpc.check_tensors(tensors)
            reply = await self.handler(Request(body, tensors, sender, address))
        except SenderFault as fault:
            if rpc.callers == "previous stage":
                self.guard.evidence.keep(sender, rpc.method, request.request_id,
                                         encode_struct(request.envelope), request.parts,
                                         str(fault))
            raise
        if not isinstance(reply.body, rpc.reply):  # a bug here, not the sender's fault
            raise TypeError(f"the {rpc.method} handler replied with {type(reply.body).__name__}, "
                            f"not {rpc.reply.__name__}")
        if reply.encoded is not None:
            out_parts, manifest = reply.encoded
        else:
            out_parts, manifest = encode_mixed(reply.tensors, reply.codec, reply.exact)
        metadata = signed_envelope(self.guard.identity, "reply", rpc.method, request.request_id,
                                   encode_struct(reply.body), manifest, out_parts)
        return to_messages(runtime_pb2.ExpertResponse, metadata, out_parts)

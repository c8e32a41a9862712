"""The base of decentrl's exceptions, and whether a refusal is its sender's fault.

Every exception class of the project derives from `DecentrlError` (most also from the builtin
they stood on before, ValueError, RuntimeError, ConnectionError..., so that code that catches
those still does). A request a peer serves that raises `SenderFault` is a strike against its
sender (net/serving.py); anything else a handler raises is not: a `DecentrlError` is a refusal
the handler meant (answered with its text), any other exception the peer's own failure. So
where a refusal is raised, its class says whether the sender did wrong."""

from __future__ import annotations


class DecentrlError(Exception):
    """An error decentrl raises on purpose; the message says what and why."""


class SenderFault(DecentrlError, ValueError):
    """The sender of a message did wrong: it is malformed, unsigned, over a limit, or asks what
    its sender may not ask. Raised while a request is served, a strike against its sender."""


def strikes_sender(error: BaseException) -> bool:
    """Whether `error`, raised while a request was served, counts against the request's
    sender."""
    return isinstance(error, SenderFault)

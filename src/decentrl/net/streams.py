"""Hivemind's framed protobuf streams, read with bounds. A stream carries frames: a marker byte
(a message, or an error), an 8-byte big-endian length, then that many bytes; the caller ends its
requests with an empty error frame (`P2P.END_OF_STREAM`). Hivemind's own reader
(`P2P.receive_raw_data`) believes any length a stranger declares and reads that much; this one
refuses a frame over the message cap or over what is left of the stream's byte limit as soon as
its header is in, before reading any of it, and (on the serving side) cuts a stream that sends
nothing for `idle_s` and takes each message's bytes from the node's budget of requests in flight
(net/inflight_budget.py) before reading it. Writes share the framing and the idle bound.

net/serving.py and net/calls.py serve and call every RPC over these streams
(`P2P.add_binary_stream_handler`, `call_binary_stream_handler`), so the wire format is
hivemind's and its clients still talk to our peers. Hivemind's DHT RPCs are unary calls
instead: the p2p daemon itself reads each one with a delimited reader capped at its
`persistentConnMaxMsgSize` (4 MiB) before Python sees it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as Protobuf
from hivemind.p2p import P2P
from hivemind.proto.p2pd_pb2 import RPCError

from decentrl.errors import DecentrlError
from decentrl.net.inflight_budget import InflightBudget, NodeBusy
from decentrl.net.text import REMOTE_ERROR_CHARS, peer_text
from decentrl.net.wire import MAX_MESSAGE_BYTES, WireError

M = TypeVar("M", bound=Protobuf)
FRAME_HEADER_BYTES = 1 + P2P.HEADER_LEN
# Bytes read or written between two checks of the idle bound.
PIECE_BYTES = 2**16


class FrameRefused(WireError):
    """A frame over a limit (refused from its header alone), or not a frame at all."""


class StreamStalled(DecentrlError, TimeoutError):
    """The other side sent nothing for the idle bound."""


class ErrorFrame(DecentrlError):
    """The other side answered with an error frame; the message is its text, made inert and cut
    (net/text.py)."""


@dataclass(frozen=True)
class Frame:
    error: bool  # an error frame (RPCError): a refusal, or the end of a caller's requests
    payload: bytes


async def write_frame(writer: asyncio.StreamWriter, message: Protobuf, idle_s: float | None
                      ) -> None:
    """One message (an RPCError goes as an error frame), waiting at most `idle_s` for each piece
    to leave: a reader that stops reading does not hold the stream forever."""
    data = memoryview(message.SerializeToString())
    marker = P2P.ERROR_MARKER if isinstance(message, RPCError) else P2P.MESSAGE_MARKER
    writer.write(marker + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    for offset in range(0, len(data), PIECE_BYTES):
        writer.write(data[offset:offset + PIECE_BYTES])
        async with asyncio.timeout(idle_s):
            await writer.drain()
    async with asyncio.timeout(idle_s):  # an empty frame has no piece
        await writer.drain()


class FrameReader:
    """The frames of one stream, `what` it carries (for errors, e.g. "inference_step request"):
    at most `limit` bytes in all, headers included, and no frame over MAX_MESSAGE_BYTES. Each
    read waits at most `idle_s` for the next bytes (None: no bound; a caller has its own
    timeout)."""

    def __init__(self, reader: asyncio.StreamReader, what: str, limit: int,
                 idle_s: float | None, budget: InflightBudget | None = None) -> None:
        self.reader, self.what, self.limit, self.idle_s = reader, what, limit, idle_s
        # The node's budget of request bytes in flight (serving side): each message takes its
        # bytes from it before it is read, and `release` gives them all back.
        self.budget = budget
        self.held = 0
        self.received = 0
        self.ended = False  # the end-of-requests frame came
        self._unread = 0  # bytes of a refused frame still on the stream
        self._broken = False  # a frame made no sense: the framing is lost

    async def _read(self, size: int) -> bytes | None:
        """Exactly `size` bytes, or None if the stream ends first."""
        pieces = []
        try:
            while size > 0:
                async with asyncio.timeout(self.idle_s):
                    piece = await self.reader.readexactly(min(size, PIECE_BYTES))
                pieces.append(piece)
                size -= len(piece)
        except asyncio.IncompleteReadError:
            return None
        except TimeoutError:
            raise StreamStalled(f"{self.what}: nothing came for {self.idle_s:g}s") from None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def next(self) -> Frame | None:
        """The next frame, or None where the stream ends (also mid-frame: it was cut)."""
        header = await self._read(FRAME_HEADER_BYTES)
        if header is None:
            return None
        marker, length = header[:1], int.from_bytes(header[1:], P2P.BYTEORDER)
        if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
            self._broken = True
            raise FrameRefused(f"{self.what}: {marker!r} is no frame marker")
        self.received += FRAME_HEADER_BYTES
        if self.received + length > self.limit:
            self._unread = length
            raise FrameRefused(f"{self.what} over {self.limit} bytes: a message of {length} "
                               f"bytes after {self.received - FRAME_HEADER_BYTES}")
        if length > MAX_MESSAGE_BYTES:
            self._unread = length
            raise FrameRefused(f"{self.what}: a message of {length} bytes is over the "
                               f"{MAX_MESSAGE_BYTES}-byte message cap")
        if self.budget is not None:
            try:
                self.budget.take(length, self.what)
            except NodeBusy:
                self._unread = length
                raise
            self.held += length
        payload = await self._read(length)
        if payload is None:
            return None
        self.received += length
        return Frame(marker == P2P.ERROR_MARKER, payload)

    def release(self) -> None:
        """Give the bytes this stream's messages held back to the node's budget."""
        if self.budget is not None:
            self.budget.give_back(self.held)
        self.held = 0

    async def requests(self, message_type: type[M]) -> list[M] | None:
        """A caller's messages up to its end-of-requests frame; None if the stream ends before
        it (the caller went away)."""
        messages = []
        while (frame := await self.next()) is not None:
            if frame.error:
                self.ended = True
                return messages
            messages.append(self._parse(message_type, frame.payload))
        return None

    async def replies(self, message_type: type[M]) -> list[M]:
        """A peer's messages until it closes the stream (a reply cut short comes back short);
        ErrorFrame if the peer refused."""
        messages = []
        while (frame := await self.next()) is not None:
            if frame.error:
                raise ErrorFrame(peer_text(self._parse(RPCError, frame.payload).message,
                                          REMOTE_ERROR_CHARS))
            messages.append(self._parse(message_type, frame.payload))
        return messages

    def _parse(self, message_type: type[M], payload: bytes) -> M:
        try:
            return message_type.FromString(payload)
        except DecodeError as error:
            raise FrameRefused(f"{self.what}: a message that does not decode as "
                               f"{message_type.__name__} ({error})") from None

    async def discard_rest(self, budget: int) -> None:
        """Read and drop what the caller still sends of a refused request, up to `budget` bytes,
        frame by frame up to its end-of-requests frame. A stream closed with unread data is
        reset, and the reset can overtake the refusal just written; an honest caller that sent
        its whole request then reads the refusal. A stream that stalls, breaks the framing or
        sends past `budget` is left unread: its caller may see only the reset."""
        try:
            while not self._broken and self._unread <= budget:
                budget -= self._unread
                if not await self._drop(self._unread) or self.ended:
                    return
                self._unread = 0
                header = await self._read(FRAME_HEADER_BYTES)
                if header is None or header[:1] not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
                    return
                budget -= FRAME_HEADER_BYTES
                self.ended = header[:1] == P2P.ERROR_MARKER
                self._unread = int.from_bytes(header[1:], P2P.BYTEORDER)
        except (StreamStalled, ConnectionError):
            return

    async def _drop(self, size: int) -> bool:
        """Read and forget `size` bytes; False if the stream ended first."""
        while size > 0:
            piece = await self._read(min(size, PIECE_BYTES))
            if piece is None:
                return False
            size -= len(piece)
        return True

    async def wait_closed(self) -> None:
        """Until the caller closes the stream or sends anything after its requests: either way it
        no longer waits for this answer."""
        try:
            await self.reader.read(1)
        except ConnectionError:
            return

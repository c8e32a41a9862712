"""The coordinator's live web dashboard: one self-contained page on localhost that polls the run's
state as JSON and draws it (reward and accuracy curves, each stage's peers, updates in flight,
verification events).

It has no authentication, so it only ever listens on a loopback address, and it answers only
requests whose Host header names one: otherwise any web page the operator opens could read the
run's state through DNS rebinding. Peer names and verification details come from untrusted peers;
the page inserts them as text only, and its Content-Security-Policy lets no script run but its own.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import math
import re
import socket
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# A client that connects and then stalls (or trickles its request) would otherwise hold its handler
# thread, and close(), forever.
CLIENT_TIMEOUT_S = 10.0

_LOOPBACK_NAMES = {"localhost"}


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _page() -> tuple[bytes, str]:
    """The page, and the Content-Security-Policy that allows exactly its one inline script."""
    html = resources.files("decentrl.observe").joinpath("dashboard.html").read_text("utf-8")
    script = re.search(r"<script>(.*?)</script>", html, re.DOTALL)
    if script is None or html.count("<script") != 1:
        raise RuntimeError("dashboard.html must hold exactly one script element, inline")
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    policy = ("default-src 'none'; "
              f"script-src 'sha256-{digest}'; style-src 'unsafe-inline'; connect-src 'self'; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), policy


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no such numbers, and the browser's
    JSON.parse rejects the whole document over one (a mean over no rollouts is NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class _Server(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], family: socket.AddressFamily,
                 state: Callable[[], dict[str, Any]], page: bytes, policy: str,
                 client_timeout_s: float | None) -> None:
        self.address_family = family
        self.state = state
        self.page = page
        self.policy = policy
        self.client_timeout_s = client_timeout_s
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A browser tab closed mid-answer, or a client that stalled past its timeout, is routine:
        # the default would print a traceback for each on stderr.
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            log.debug("dashboard: client %s went away", client_address, exc_info=True)
        else:
            log.exception("dashboard: request from %s failed", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def setup(self) -> None:
        # StreamRequestHandler.setup applies `timeout` to the connection: the server's, so a test
        # can make a stalled client stall forever.
        self.timeout = self.server.client_timeout_s
        super().setup()

    def do_GET(self) -> None:
        host = urlsplit(f"//{self.headers.get('Host', '')}").hostname or ""
        if not _is_loopback(host):
            self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain", b"not a loopback host\n")
            return
        path = urlsplit(self.path).path
        if path == "/":
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.page,
                       {"Content-Security-Policy": self.server.policy})
        elif path == "/api/state":
            self._send_state()
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")

    def _send_state(self) -> None:
        try:
            body = json.dumps(_finite(self.server.state()), allow_nan=False).encode()
        except Exception as error:
            log.exception("dashboard: the run's state could not be read")
            body = json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", body)
            return
        self._send(HTTPStatus.OK, "application/json", body)

    def _send(self, status: HTTPStatus, content_type: str, body: bytes,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # The page polls every 2 s; one stderr line per request would bury the run's own log.
        log.debug("dashboard: %s " + format, self.address_string(), *args)


class DashboardServer:
    """Serves the dashboard: `GET /` the page, `GET /api/state` the JSON of `state()`, called
    afresh on every request from a handler thread (so it must be safe to call from any thread).
    A client that sends nothing for `client_timeout_s` is dropped (None: never)."""

    def __init__(self, state: Callable[[], dict[str, Any]], host: str = "127.0.0.1",
                 port: int = 0, client_timeout_s: float | None = CLIENT_TIMEOUT_S) -> None:
        if not _is_loopback(host):
            raise ValueError(f"the dashboard has no authentication and serves only on a loopback "
                             f"address (127.0.0.1, ::1, localhost), not {host!r}")
        self._state = state
        self._host = host
        self._port = port
        self._client_timeout_s = client_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                raise RuntimeError("the dashboard is already started")
            page, policy = _page()
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            self._server = _Server((self._host.strip("[]"), self._port), family, self._state,
                                   page, policy, self._client_timeout_s)
            self._thread = threading.Thread(target=self._server.serve_forever,
                                            name="dashboard", daemon=True)
            self._thread.start()
        log.info("dashboard: %s", self.url)

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the dashboard is not started")
        host, port = self._server.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}/"

    def close(self) -> None:
        with self._lock:
            server, thread = self._server, self._thread
            self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

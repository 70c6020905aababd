"""uvicorn's httptools HTTP/1.1 protocol with the bounds a server facing the internet needs
on each connection, before the application sees a request:

- a request head (request line and headers) is cut off with 431 once its headers pass
  MAX_HEADER_BYTES or its URL MAX_URL_BYTES, counted on the raw bytes as they arrive:
  httptools itself would buffer a header of any length until it ends;
- a connection has `header_timeout` seconds, from when it opens or its last response ends,
  to deliver a whole head (408 and closed otherwise): a client that opens connections and
  sends nothing, or a header a byte at a time, does not hold them;
- a request body must bring at least `min_body_rate` bytes a second over each window of
  `body_timeout` seconds (408 and closed otherwise), not counting time the server itself
  stopped reading (its buffer full, or a `100 Continue` not sent yet);
- at most `max_connections` connections at once per worker process: one more is answered
  503 and closed at once, so descriptors never run out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from kvgraft.server.settings import ServerSettings

MAX_HEADER_BYTES = 64 << 10  # all header lines together (the app checks the parsed ones too)
MAX_URL_BYTES = 1 << 20  # a prefix-match query travels in the URL
_HEAD_SLACK = 1 << 10  # method, version and line ends
_CODES = {408: "UNSUPPORTED", 431: "SIZE_INVALID", 503: "UNAVAILABLE"}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 20.0
    min_body_rate: int = 1024
    max_connections: int = 512

    @classmethod
    def of(cls, settings: ServerSettings) -> ConnectionLimits:
        return cls(settings.header_timeout, settings.body_timeout, settings.min_body_rate,
                   settings.max_connections)


_limits = ConnectionLimits()


def configure(limits: ConnectionLimits) -> None:
    """Set this worker process's limits (before it serves: `main.app_from_env`)."""
    global _limits
    _limits = limits


class GuardedHttpTools(HttpToolsProtocol):
    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = _limits
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = True
        self._head_bytes = 0
        self._window_bytes = 0

    # --- the connection --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "too many connections; retry later")
            return
        self._arm(self.limits.header_timeout, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            url = len(self.url) if self._head_bytes else 0
            if url > MAX_URL_BYTES or \
                    self._head_bytes - url > MAX_HEADER_BYTES + _HEAD_SLACK:
                self._refuse(431, "request head too large")
                return
        super().data_received(data)
        if self._in_head:
            self._head_bytes += len(data)

    # --- parser callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._window_bytes = 0
        self._arm(self.limits.body_timeout, self._body_check)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._window_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's head is in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._in_head, self._head_bytes = True, 0
            self._arm(self.limits.header_timeout, self._head_late)

    # --- timers ----------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_late(self) -> None:
        self._timer = None
        if self._in_head:
            self._refuse(408, "request head not received in time")

    def _body_check(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return
        waiting = self.flow.read_paused or cycle.waiting_for_100_continue
        if not waiting and \
                self._window_bytes < self.limits.min_body_rate * self.limits.body_timeout:
            self._refuse(408, "request body too slow")
            return
        self._window_bytes = 0
        self._arm(self.limits.body_timeout, self._body_check)

    def _refuse(self, status: int, why: str) -> None:
        """Answer `status` (if no response has begun) and close the connection; the
        request's handler, if any, sees the client gone."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            # The OCI error shape, as every other refusal.
            body = json.dumps({"errors": [{"code": _CODES[status], "message": why,
                                           "detail": None}]}).encode()
            self.transport.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n",
                body]))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.logger.warning("%s: %s", self.client[0] if self.client else "?", why)
        self.transport.close()

"""A throttled link for the tests, without root: a threaded TCP proxy on loopback that
forwards to an upstream (an S3 server) at `bytes_per_s` each way, shared by all its
connections, and delays each response by `latency` seconds (the first bytes the upstream
sends after the client spoke).

    with Throttle("127.0.0.1", 8333, bytes_per_s=10e6, latency=0.02) as link:
        env["KVGRAFT_S3_ENDPOINT_URL"] = link.url

As a process of its own (its pumps then share no interpreter with the engine it serves):

    python -m tests.support.throttle HOST PORT BYTES_PER_S LATENCY

prints its URL, then reads a new rate (bytes/s) a line from stdin, answering "ok" to each,
until stdin closes.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from types import TracebackType

PIECE = 16 * 1024


class Bucket:
    """A token bucket of `rate` bytes/s (bursts of at most one piece)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = self._next - now - PIECE / self.rate
        if wait > 0:
            time.sleep(wait)


class Throttle:
    def __init__(self, host: str, port: int, *, bytes_per_s: float,
                 latency: float = 0.0) -> None:
        self.upstream = (host, port)
        self.latency = latency
        self.down, self.up = Bucket(bytes_per_s), Bucket(bytes_per_s)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, name="throttle", daemon=True).start()

    def set_rate(self, bytes_per_s: float) -> None:
        self.down.rate = self.up.rate = bytes_per_s

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            spoke = threading.Event()  # the client sent a request the server has not answered
            threading.Thread(target=self._pump, args=(client, server, self.up, spoke, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down, spoke, True),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: Bucket,
              spoke: threading.Event, answers: bool) -> None:
        try:
            while True:
                data = src.recv(PIECE)
                if not data:
                    break
                if not answers:
                    spoke.set()
                elif spoke.is_set():  # the first bytes of a response
                    spoke.clear()
                    if self.latency:
                        time.sleep(self.latency)
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def main(argv: list[str]) -> None:
    host, port, rate, latency = argv
    with Throttle(host, int(port), bytes_per_s=float(rate), latency=float(latency)) as link:
        print(link.url, flush=True)
        for line in sys.stdin:
            link.set_rate(float(line))
            print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

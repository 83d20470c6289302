"""A real HTTP file server on 127.0.0.1 for download tests: Range support and scripted faults; POSTs are
kept (a webhook receiver for notification tests)."""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Fault:
    """What the server does to one request instead of (or while) answering it normally.

    kind: "cut" sends the headers and ``cut_after`` bytes, then drops the connection;
    "status" answers ``status`` (with ``retry_after`` if given); "ignore_range" answers 200 with
    the whole file even when a Range was asked; "slow" sleeps ``delay`` s between 64 KiB chunks;
    "chunked" sends the body with chunked transfer encoding, so its size is not announced; "hold" answers
    only once ``gate`` is set (requests a test lets through together).
    """

    kind: str
    status: int = 500
    cut_after: int = 0
    retry_after: str | None = None
    delay: float = 0.0
    gate: threading.Event | None = None


@dataclass
class FileServer:
    files: dict[str, bytes] = field(default_factory=dict)
    #: Files of zeros as large as given, produced while they are sent (a 10 GB archive, without 10 GB).
    zeros: dict[str, int] = field(default_factory=dict)
    faults: deque[Fault] = field(default_factory=deque)
    requests: list[dict] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.port}/{name}"


def make_handler(state: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def do_GET(self) -> None:
            name, _, query = self.path.lstrip("/").partition("?")
            range_header = self.headers.get("Range")
            state.requests.append({"path": name, "range": range_header, "query": query})
            fault = state.faults.popleft() if state.faults else None
            if fault and fault.kind == "hold" and fault.gate is not None:
                fault.gate.wait()
            if fault and fault.kind == "status":
                self.send_response(fault.status)
                if fault.retry_after is not None:
                    self.send_header("Retry-After", fault.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if name in state.zeros:
                self._send_zeros(state.zeros[name], chunked=bool(fault and fault.kind == "chunked"))
                return
            data = state.files.get(name)
            if data is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = 0
            match = re.match(r"bytes=(\d+)-$", range_header or "")
            if match and not (fault and fault.kind == "ignore_range"):
                start = int(match.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if fault and fault.kind == "cut":
                self.wfile.write(body[: fault.cut_after])
                self.wfile.flush()
                self.close_connection = True
                return
            for offset in range(0, len(body), 1 << 16):
                self.wfile.write(body[offset : offset + (1 << 16)])
                if fault and fault.kind == "slow":
                    time.sleep(fault.delay)

        def do_POST(self) -> None:
            """A webhook receiver: the body is kept in ``requests`` (what a notification block sent), 204."""
            length = int(self.headers.get("Content-Length") or 0)
            state.requests.append({"path": self.path.lstrip("/"), "method": "POST", "body": self.rfile.read(length),
                                   "content_type": self.headers.get("Content-Type")})
            self.send_response(204)
            self.end_headers()

        def _send_zeros(self, size: int, chunked: bool) -> None:
            self.send_response(200)
            self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(size))))
            self.end_headers()
            block = bytes(1 << 16)
            try:
                for offset in range(0, size, len(block)):
                    piece = block[: min(len(block), size - offset)]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as a real server
                self.close_connection = True

    return Handler


class RunningServer:
    """The file server on ``host`` (loopback unless told otherwise: pods of the emulated cluster reach this
    machine at the pod network's node address instead)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.state = FileServer(host=host)
        self._httpd = ThreadingHTTPServer((host, 0), make_handler(self.state))
        self._httpd.daemon_threads = True
        self.state.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FileServer:
        self._thread.start()
        return self.state

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

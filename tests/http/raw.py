"""Raw HTTP/1.1 over a socket, for tests that need to control what arrives together."""

from __future__ import annotations

import socket

from tests.http.harness import Served

TIMEOUT = 30.0


def connect(served: Served) -> socket.socket:
    sock = socket.create_connection((served.server.host, served.server.port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (blocking reads)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_answers(sock: socket.socket, n: int) -> list[bytes]:
    """``n`` whole answers (each with a Content-Length), in the order they came."""
    data = b""
    answers: list[bytes] = []
    while len(answers) < n:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].lower()
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            end = head_end + 4 + length
            if len(data) >= end:
                answers.append(data[:end])
                data = data[end:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(answers)} of {n} answers"
        data += chunk
    return answers


def status(answer: bytes) -> int:
    """The status code of one answer."""
    assert answer.startswith(b"HTTP/1."), answer[:80]
    return int(answer.split(b" ", 2)[1])


def publish(topic: str, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    """A ``POST /topics/{topic}`` request with a Content-Length."""
    lines = [b"POST /topics/" + topic.encode() + b" HTTP/" + version, b"Host: x",
             b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def split_answers(data: bytes) -> list[bytes]:
    """The answers in ``data`` (each with a Content-Length), in order."""
    answers = []
    while data:
        head_end = data.index(b"\r\n\r\n")
        head = data[:head_end].lower()
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        end = head_end + 4 + length
        answers.append(data[:end])
        data = data[end:]
    return answers

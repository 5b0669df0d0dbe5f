"""Raw HTTP/1.1 over a socket, for tests that need to control what arrives together."""

from __future__ import annotations

import os
import select
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


def send_until_answered(served: Served, head: bytes, piece: bytes, most: int,
                        timeout: float = 30.0) -> tuple[int | None, int, bytes]:
    """Send ``head``, then ``piece`` after ``piece`` until the server answers (or closes)
    or ``most`` bytes went; (bytes sent when it answered or None, bytes sent, the answer).
    A small send buffer, so that "sent" is close to what the server had to read. A reset
    where the answer should be raises ``ConnectionResetError``."""
    sent = 0
    answered_after: int | None = None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.settimeout(timeout)
        sock.connect((served.server.host, served.server.port))
        sock.sendall(head)
        try:
            while sent < most:
                sock.sendall(piece)
                sent += len(piece)
                if select.select([sock], [], [], 0.01)[0]:
                    answered_after = sent
                    break
        except ConnectionError:
            answered_after = sent
        answer = read_until_closed(sock)
    return answered_after, sent, answer


def server_descriptors(port: int) -> int:
    """Descriptors of this process that are the server's connections on ``port`` (the
    clients' sockets, in the same process, have another local port)."""
    inodes: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":
                    inodes.add(fields[9])
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            count += 1
    return count

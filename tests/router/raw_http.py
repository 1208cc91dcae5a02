"""Raw HTTP/1.1 over a socket, for the edge tests that send what no client library would
(a lying Content-Length, a body that trickles or never ends)."""

from __future__ import annotations

import socket


def connect(url: str, head: bytes, first_bytes: bytes = b"") -> socket.socket:
    """A connection to ``url`` (``http://host:port``) that has sent a request head and the
    start of its body."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(head + first_bytes)
    return s


def read_reply(s: socket.socket) -> bytes:
    """The reply, up to the end of its JSON body (or the connection's close)."""
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    return reply


def exchange(url: str, head: bytes, first_bytes: bytes) -> bytes:
    """Send a request head and the start of its body, then read the reply."""
    with connect(url, head, first_bytes) as s:
        return read_reply(s)

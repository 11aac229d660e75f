"""A minimal synchronous RESP2 client for the private Redis server: pipelined commands on a
fresh connection (readiness probes, ``FLUSHALL``)."""

from __future__ import annotations

import socket
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

HOST = "127.0.0.1"


class RespError(Exception):
    pass


def read_reply(stream: IO[bytes]) -> bytes | int | list[object] | None:
    """Read one RESP2 reply; enough of the protocol for INFO, PING and FLUSHALL."""
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise RespError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = stream.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed mid-reply")
        return data[:-2]
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [read_reply(stream) for _ in range(count)]
    raise ConnectionError(f"not a RESP reply: {line[:40]!r}")


def call(port: int, commands: Sequence[Sequence[str]], timeout: float) -> list[object]:
    """Send ``commands`` pipelined on a fresh connection; return one reply (or error) each."""
    payload = bytearray()
    for command in commands:
        payload += b"*%d\r\n" % len(command)
        for arg in command:
            raw = arg.encode()
            payload += b"$%d\r\n%s\r\n" % (len(raw), raw)
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(payload)
        with sock.makefile("rb") as stream:
            replies: list[object] = []
            for _ in commands:
                try:
                    replies.append(read_reply(stream))
                except RespError as exc:
                    replies.append(exc)
            return replies

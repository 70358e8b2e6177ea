"""
Reading HTTP answers with a bound. treq buffers a whole body unless the request says
C{unbuffered=True}; these read an unbuffered response's body as it arrives and stop (closing
the connection) at a limit, so a peer sending gigabytes (a workload's health endpoint, a
hostile backend or Loki) costs at most the limit.
"""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet.protocol import Protocol

__all__ = ["BodyTooLarge", "drop_body", "read_body", "read_prefix"]


class BodyTooLarge(Exception):
    """The answer is larger than the limit (the message says so, one line)."""


class _Enough(Exception):
    pass


class _Drop(Protocol):
    def connectionMade(self) -> None:  # noqa: N802 - Twisted's name
        self.transport.stopProducing()  # type: ignore[union-attr]  # aborts the connection


def drop_body(response: Any) -> None:
    """Read none of the body: the connection is closed at once (a peer that sends an endless
    body, or none at all, costs nothing and holds nothing)."""
    response.deliverBody(_Drop())


async def read_body(response: Any, limit: int) -> bytes:
    """The whole body, or L{BodyTooLarge} as soon as more than C{limit} bytes arrived."""
    chunks: list[bytes] = []
    size = 0

    def collect(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > limit:
            raise BodyTooLarge(f"the answer is larger than {limit} bytes")
        chunks.append(data)

    await treq.collect(response, collect)
    return b"".join(chunks)


async def read_prefix(response: Any, limit: int) -> bytes:
    """At most the first C{limit} bytes of the body; the rest is not read (the connection closes)."""
    chunks: list[bytes] = []
    size = 0

    def collect(data: bytes) -> None:
        nonlocal size
        room = limit - size
        chunks.append(data[:room])
        size += min(len(data), room)
        if len(data) >= room:
            raise _Enough()

    try:
        await treq.collect(response, collect)
    except _Enough:
        pass
    return b"".join(chunks)

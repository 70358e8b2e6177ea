"""
A loopback TCP proxy that cuts, stalls, slows and corrupts, on cue or at random (seeded).

Put it between the agent and the stand-in backend (or Loki): point the agent at
C{http://127.0.0.1:<proxy port>} and the proxy at the server's port. Faults:

 - L{ChaosProxy.cut}: reset every connection both ways (no FIN, no close frame);
 - L{ChaosProxy.stall}: hold every byte both ways, connections open, until L{ChaosProxy.heal}
   (then the held bytes flow on, in order);
 - L{ChaosProxy.slow}: forward in small chunks with a delay between them;
 - L{ChaosProxy.corrupt}: damage the next chunk in one direction, either C{flip} (the top
   bit of one byte) or C{garble} (a run of bytes replaced by bytes >= 0x80);
 - L{ChaosProxy.refuse}: close new connections at once (the server "down" behind a gateway).

Corruption is the kind a receiver can detect, as TCP checksums and TLS turn real damage into
a broken connection: a flipped top bit or a byte >= 0x80 inside a WebSocket text frame is
invalid UTF-8 whether or not the frame is masked (masking is XOR), and in a frame header it is
a protocol error, a wrong length or a masked frame from the server. Silent semantic changes (a
digit of a command id turned into another digit) are outside what any agent can defend
against without TLS, so the proxy does not make them.

L{ChaosProxy.random_fault} picks one fault with the given C{random.Random}; callers seed it
and print the seed on failure.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from tests.support.proxy import LoopbackProxy, _Front

FAULTS = ("cut", "stall", "slow", "flip", "garble", "refuse")
UP, DOWN = "up", "down"  # client to server, server to client


class _Pipe:
    """One direction of one connection: a queue honouring stalls and slow links."""

    def __init__(self, proxy: ChaosProxy, front: _Front, direction: str) -> None:
        self.proxy = proxy
        self.front = front
        self.direction = direction
        self.queue: deque[bytes] = deque()
        self.timer: Any = None

    def push(self, data: bytes) -> None:
        self.queue.append(data)
        self.pump()

    def pump(self) -> None:
        p = self.proxy
        if self.timer is not None or p.stalled:
            return
        while self.queue:
            if p.slow_chunk is not None:
                head = self.queue.popleft()
                chunk, rest = head[: p.slow_chunk], head[p.slow_chunk :]
                if rest:
                    self.queue.appendleft(rest)
                self._write(chunk)
                if self.queue:
                    self.timer = p.reactor.callLater(p.slow_delay, self._tick)
                return
            self._write(self.queue.popleft())

    def _tick(self) -> None:
        self.timer = None
        self.pump()

    def _write(self, data: bytes) -> None:
        data = self.proxy.damage(self.direction, data)
        self.proxy.bytes[self.direction] += len(data)
        if self.direction == UP:
            self.front.write_server(data)
        else:
            self.front.write_client(data)

    def cancel(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        self.queue.clear()


class ChaosProxy(LoopbackProxy):
    """
    See the module docstring.

    @ivar log: what was done, in order (C{"cut"}, C{"flip down"}, ...), for failure messages.
    @ivar counts: faults applied, by kind.
    """

    def __init__(self, reactor: Any, target_port: int) -> None:
        super().__init__(reactor, target_port)
        self.stalled = False
        self.refusing = False
        self.slow_chunk: int | None = None
        self.slow_delay = 0.0
        self._corrupt: dict[str, str | None] = {UP: None, DOWN: None}
        self._pipes: dict[_Front, tuple[_Pipe, _Pipe]] = {}
        self.rng = random.Random(0)
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.bytes = {UP: 0, DOWN: 0}
        #: Cuts that reset at least one open connection.
        self.live_cuts = 0

    def retarget(self, port: int) -> None:
        """Forward new connections to C{port} (the server came back elsewhere)."""
        self.target_port = port

    # -- hooks -----------------------------------------------------------------------------

    def _pipe(self, front: _Front, direction: str) -> _Pipe:
        pipes = self._pipes.get(front)
        if pipes is None:
            pipes = (_Pipe(self, front, UP), _Pipe(self, front, DOWN))
            self._pipes[front] = pipes
        return pipes[0] if direction == UP else pipes[1]

    def to_server(self, front: _Front, data: bytes) -> None:
        self._pipe(front, UP).push(data)

    def to_client(self, front: _Front, data: bytes) -> None:
        self._pipe(front, DOWN).push(data)

    def forward_close(self, front: _Front) -> bool:
        return True

    def accepting(self) -> bool:
        return not self.refusing

    def front_lost(self, front: _Front) -> None:
        for pipe in self._pipes.pop(front, ()):
            pipe.cancel()

    def damage(self, direction: str, data: bytes) -> bytes:
        mode = self._corrupt[direction]
        if mode is None or not data:
            return data
        self._corrupt[direction] = None
        buf = bytearray(data)
        at = self.rng.randrange(len(buf))
        if mode == "flip":
            buf[at] ^= 0x80
        else:
            for i in range(at, min(len(buf), at + self.rng.randint(1, 16))):
                buf[i] = self.rng.randint(0x80, 0xFF)
        return bytes(buf)

    # -- faults ----------------------------------------------------------------------------

    def _note(self, what: str) -> None:
        self.log.append(what)
        kind = what.split()[0]
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def cut(self) -> int:
        """Reset every open connection; return how many were cut."""
        self._note("cut")
        fronts = list(self.fronts)
        for front in fronts:
            front.abort()
        if fronts:
            self.live_cuts += 1
        return len(fronts)

    def stall(self) -> None:
        """Hold every byte, both ways, until L{heal}."""
        self._note("stall")
        self.stalled = True

    def slow(self, chunk: int = 64, delay: float = 0.02) -> None:
        """Forward C{chunk} bytes every C{delay} seconds per direction, until L{heal}."""
        self._note("slow")
        self.slow_chunk = chunk
        self.slow_delay = delay

    def corrupt(self, direction: str = DOWN, mode: str = "flip") -> None:
        """Damage the next chunk going C{direction} (L{UP} or L{DOWN}); C{flip} or C{garble}."""
        if mode not in ("flip", "garble") or direction not in (UP, DOWN):
            raise ValueError(f"corrupt({direction!r}, {mode!r})")
        self._note(f"{mode} {direction}")
        self._corrupt[direction] = mode

    def refuse(self) -> None:
        """Close new connections at once, until L{heal}."""
        self._note("refuse")
        self.refusing = True

    def heal(self) -> None:
        """End stalls, slow links, refusals and pending corruption; held bytes flow on."""
        self.stalled = False
        self.refusing = False
        self.slow_chunk = None
        self._corrupt = {UP: None, DOWN: None}
        for pipes in list(self._pipes.values()):
            for pipe in pipes:
                pipe.pump()

    def random_fault(self, rng: random.Random, kinds: tuple[str, ...] = FAULTS,
                     directions: tuple[str, ...] = (UP, DOWN)) -> str:
        """Heal, then apply one fault chosen by C{rng}; return its name."""
        self.heal()
        self.rng = rng
        kind = rng.choice(kinds)
        if kind == "cut":
            self.cut()
        elif kind == "stall":
            self.stall()
        elif kind == "slow":
            self.slow(chunk=rng.choice((1, 16, 64, 512)), delay=rng.choice((0.001, 0.01, 0.03)))
        elif kind in ("flip", "garble"):
            self.corrupt(rng.choice(directions), kind)
        elif kind == "refuse":
            self.refuse()
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return kind

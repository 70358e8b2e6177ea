"""
What answers on the agent's loopback ops port, and whether it is the agent (C{status}, C{doctor}).

Any local user can listen on that port while the agent is down. Root's tools believe an answer
only when the process that holds the agent's instance lock (C{<state>.lock}, an exclusive
C{flock} the agent takes first at start and holds for its life: L{llmport_agent.host.instance}) is
the process that owns the listening socket on that port: the lock's holder from
C{/proc/locks} (matched by the lock file's device and inode), the socket's inode from
C{/proc/net/tcp} and C{tcp6} (state LISTEN, that port), and that inode among the holder's
descriptors (C{/proc/<pid>/fd}). Checked before the request and again after the answer.

The request is one C{GET} with C{http.client}: a redirect is never followed (its target is never
contacted), at most L{BODY_LIMIT} bytes are read, and it is bounded by a timeout.

Blocking (a command line tool's work, never on the agent's reactor).
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Any

from llmport_agent.core.values import frozen
from llmport_agent.host.instance import lock_path

#: The most bytes of an answer read.
BODY_LIMIT = 1 << 20
#: The most lines of /proc/locks and /proc/net/tcp* read (a host with many locks or sockets).
_PROC_LINES = 1 << 18


class Unverifiable(Exception):
    """This user cannot see who answers (not root: the state directory or /proc/<pid>/fd is closed)."""


@frozen
class OpsAnswer:
    """
    @ivar answered: something accepted the connection and answered HTTP.
    @ivar body: its JSON object (C{None}: none, or not an object).
    @ivar trusted: it is the agent (the lock's holder owns the listening socket).
    @ivar pid: the agent's PID when trusted.
    @ivar note: when not trusted, why (one clause, for a line).
    @ivar status: the HTTP status (a 3xx is shown as such, never followed).
    @ivar unverifiable: this user cannot tell who answered (not root).
    """

    answered: bool
    body: dict[str, Any] | None = None
    trusted: bool = False
    pid: int | None = None
    note: str = ""
    status: int = 0
    unverifiable: bool = False


def lock_holder(state_path: str, proc: str = "/proc") -> int | None:
    """
    The PID holding the agent's instance lock of C{state_path} (C{None}: nobody holds it).

    @raise Unverifiable: the lock file cannot be looked at (permissions).
    """
    path = lock_path(state_path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise Unverifiable(f"{path} cannot be looked at by this user") from None
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open(os.path.join(proc, "locks"), encoding="ascii", errors="replace") as f:
            for n, line in enumerate(f):
                if n >= _PROC_LINES:
                    break
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5334180 0 EOF"; "1: -> FLOCK ..." waits.
                if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
                    continue
                try:
                    major, minor, ino = fields[5].split(":")
                    if (int(major, 16), int(minor, 16), int(ino)) == wanted:
                        pid = int(fields[4])
                        return pid if pid > 0 else None
                except ValueError:
                    continue
    except OSError:
        raise Unverifiable(f"{proc}/locks cannot be read") from None
    return None


#: The local addresses (as /proc/net/tcp{,6} write them) a connection to 127.0.0.1 can reach:
#: 127.0.0.1 and 0.0.0.0; ::ffff:127.0.0.1 and :: (a dual-stack listener).
_REACHABLE = {"0100007F", "00000000", "0000000000000000FFFF00000100007F", "00000000000000000000000000000000"}


def listening_inodes(port: int, proc: str = "/proc") -> set[int]:
    """
    The inodes of the TCP sockets listening on C{port} that a connection to 127.0.0.1 can reach
    (a listener on another loopback address, 127.0.0.2 say, answers no such connection).
    """
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        if name == "tcp6" and out:
            # An IPv4 listener reaching 127.0.0.1 takes that connection; beside it a [::] one
            # can only be v6only (a dual-stack one could not bind): 127.0.0.1 never reaches it.
            # A v4-mapped 127.0.0.1 one cannot bind beside it either.
            break
        try:
            with open(os.path.join(proc, "net", name), encoding="ascii", errors="replace") as f:
                for n, line in enumerate(f):
                    if n == 0:
                        continue
                    if n >= _PROC_LINES:
                        break
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != "0A":
                        continue
                    try:
                        address, hex_port = fields[1].rsplit(":", 1)
                        if int(hex_port, 16) == port and address.upper() in _REACHABLE:
                            out.add(int(fields[9]))
                    except (ValueError, IndexError):
                        continue
        except FileNotFoundError:
            continue
        except OSError:
            raise Unverifiable(f"{proc}/net/{name} cannot be read") from None
    return out


def owns_sockets(pid: int, inodes: set[int], proc: str = "/proc") -> bool:
    """Whether every one of C{inodes} is among process C{pid}'s descriptors."""
    fd_dir = os.path.join(proc, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    except PermissionError:
        raise Unverifiable(f"{fd_dir} cannot be read by this user") from None
    held: set[int] = set()
    for name in names[:1 << 20]:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                held.add(int(target[8:-1]))
            except ValueError:
                continue
    return bool(inodes) and inodes <= held


def who_listens(port: int, state_path: str, proc: str = "/proc") -> tuple[int | None, str]:
    """
    (the agent's PID, "") when the holder of C{state_path}'s lock owns every socket listening on
    C{port}; else (C{None}, why).

    @raise Unverifiable: this user cannot tell.
    """
    pid = lock_holder(state_path, proc)
    if pid is None:
        return None, f"no agent holds {lock_path(state_path)} (the agent is not running)"
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None, f"nothing listens on port {port}"
    if not owns_sockets(pid, inodes, proc):
        return None, f"the port is held by another process than the agent (pid {pid}, the holder of its lock)"
    return pid, ""


def _fetch(port: int, path: str, timeout: float) -> tuple[int, bytes] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        response = conn.getresponse()
        return response.status, response.read(BODY_LIMIT)
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def probe(port: int, state_path: str, *, path: str = "/readyz", timeout: float = 3.0,
          proc: str = "/proc") -> OpsAnswer:
    """
    C{GET path} on C{127.0.0.1:port}, and whether the agent of C{state_path} answered it.
    Unverifiable (not root) is C{trusted=False} with a note saying so.
    """
    try:
        before: tuple[int | None, str] | None = who_listens(port, state_path, proc)
    except Unverifiable as e:
        before, unverifiable = None, str(e)
    else:
        unverifiable = ""
    got = _fetch(port, path, timeout)
    if got is None:
        return OpsAnswer(False)
    status, raw = got
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    body = data if isinstance(data, dict) else None
    if before is None:
        return OpsAnswer(True, body, False, None, f"who answers cannot be verified ({unverifiable}; run as root)",
                         status, unverifiable=True)
    try:
        after = who_listens(port, state_path, proc)
    except Unverifiable as e:  # pragma: no cover - the same checks just passed
        return OpsAnswer(True, body, False, None, str(e), status)
    pid = before[0] if before[0] is not None and before[0] == after[0] else None
    if pid is None:
        return OpsAnswer(True, body, False, None, before[1] or after[1] or "the agent changed while it answered",
                         status)
    if 300 <= status < 400:
        return OpsAnswer(True, None, True, pid, f"it answered with a redirect (HTTP {status}), not followed", status)
    return OpsAnswer(True, body, True, pid, "", status)


__all__ = ["BODY_LIMIT", "OpsAnswer", "Unverifiable", "probe", "who_listens"]

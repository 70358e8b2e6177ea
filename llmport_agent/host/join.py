"""
C{llmport-agent join [URL] [--user]}: join the current llm-port without a token (protocol 10.7).

The node asks (C{POST .../join-requests}), prints the short code a person compares and approves
in the llm-port UI, and polls C{.../collect} every few seconds for up to 15 minutes. The request
(its id, the backend and the poll secret, which the backend hands out once) is kept in the state
file under C{pending_join}, the original agent's key, so a run cut short (Ctrl-C, a dropped SSH
session) is resumed by the next one. Every outcome is one line; an approval stores the
credential (mode 0600, atomically) and the caller goes on as C{start} does.

A node whose stored credential still works (C{GET /api/node-files/whoami} answers 200) is
already a member: no request is filed, and C{start} upgrades it in place.

L{Joiner.run} does the backend dialog on the reactor (state file reads and writes on a thread);
the CLI runs it, then the installer's C{start}.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import IO, Any
from urllib.parse import urlsplit

from attrs import field
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import Logger

from llmport_agent import VERSION
from llmport_agent.core.cleantext import BadNodeId, checked_node_id, shown
from llmport_agent.core.config import AgentConfig, mask_url
from llmport_agent.core.state import load_state
from llmport_agent.core.storage import atomic_write, ensure_private_dir
from llmport_agent.core.values import define
from llmport_agent.host.instance import AlreadyRunning, InstanceLock
from llmport_agent.session.backend_http import BackendHTTP, Rejected, RouteMissing, Transient

#: How long one run waits for a decision (the backend keeps a request 15 minutes).
JOIN_WAIT_SEC = 15 * 60.0
#: Between two collects: a person walks to a browser; no need to hurry the backend.
JOIN_POLL_SEC = 3.0
#: Between two "still waiting" lines.
WAITING_LINE_SEC = 60.0

#: What the CLI does next.
JOINED = 0  # a credential is stored: go on as `start`
MEMBER = 0  # already a member: go on as `start` (an upgrade)
EX_FAIL = 1

TOKEN_START = (
    "mint an enrollment token in llm-port (POST /api/admin/system/nodes/enrollment-tokens) and run "
    "sudo LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN=<token> llmport-agent start"
)


class InsecureURL(ValueError):
    """A URL join will not send a credential or a request to (plain http without consent, another scheme)."""


def normalise_url(raw: str, insecure_http: bool = False, known: tuple[str | None, ...] = ()) -> str:
    """
    What a person typed as the backend's URL -> the URL joined. A bare C{host:port} is https
    (with C{insecure_http}: http, as asked). An C{http://} URL is refused (L{InsecureURL}) unless
    C{insecure_http} says the operator accepts clear text, or it is one of C{known} (the URL this
    node is already configured for: nothing new is exposed).
    """
    value = raw.strip()
    if "://" not in value:
        return f"{'http' if insecure_http else 'https'}://{value}"
    scheme = value.split("://", 1)[0].lower()
    if scheme == "https":
        return value
    if scheme != "http":
        raise InsecureURL(f"{shown(value, 200)}: join talks to llm-port over https (or http with "
                          "--insecure-http); give https://HOST[:PORT]")
    if insecure_http or any(k and same_backend(k, value) for k in known):
        return value
    raise InsecureURL(f"{mask_url(value)} is plain http: the join request, and the credential once approved, "
                      "would cross the network in clear text. Use https://, or add --insecure-http if this "
                      "network is trusted")


def _origin(url: str) -> tuple[str, str, int | None, str]:
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None:
        port = {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def same_backend(a: str, b: str) -> bool:
    """Whether two BACKEND_URLs name the same backend (scheme, host, port and path; case and a trailing / aside)."""
    return _origin(a) == _origin(b)


def credential_issuer(state: dict[str, Any], configured_url: str | None) -> str | None:
    """
    The backend that issued the state's credential: the one recorded with it (C{backend_url},
    written at enrollment and at an approved join), else (a state from before that record, the
    original agent's) the C{BACKEND_URL} the service was configured with; C{None}: unknown.
    """
    recorded = state.get("backend_url")
    if isinstance(recorded, str) and recorded:
        return recorded
    return configured_url or None


def _read_state(path: str) -> dict[str, Any]:
    return load_state(path).data


def _write_state(path: str, changes: dict[str, Any]) -> None:
    """Read-modify-write (every other key, the original agent's included, kept); None deletes."""
    data = dict(load_state(path).data)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    data.setdefault("version", 1)
    ensure_private_dir(os.path.dirname(os.path.abspath(path)))
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode(), 0o600)


@define
class Joiner:
    """
    One run of C{join}.

    @param state_path: the state file (the configured one, under the installer's root in tests).
    @param capabilities: fires with the static capabilities (as the agent sends at enrollment).
    """

    reactor: Any
    config: AgentConfig
    backend: BackendHTTP
    state_path: str
    capabilities: Callable[[], Deferred[dict[str, Any]]]
    out: IO[str]
    err: IO[str]
    poll_sec: float = JOIN_POLL_SEC
    wait_sec: float = JOIN_WAIT_SEC
    wallclock: Callable[[], float] = time.time
    lock: InstanceLock | None = None
    #: The BACKEND_URL the service was configured with before this join (the env file's): the
    #: issuer of a stored credential that has no record of its own (see L{credential_issuer}).
    configured_url: str | None = None
    member: dict[str, Any] | None = None
    log: Logger = field(factory=Logger)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def fail(self, text: str) -> int:
        print(f"llmport-agent: {text}", file=self.err, flush=True)
        self.log.error("join: {line}", line=text)
        return EX_FAIL

    @property
    def url(self) -> str:
        return self.config.backend_url

    async def run(self) -> int:
        """Join (or find the node already a member). 0: go on as C{start}; else the exit status."""
        try:
            state = await deferToThread(_read_state, self.state_path)
        except Exception as e:  # StateUnreadable: permissions, I/O
            return self.fail(str(e))
        credential = state.get("credential")
        if isinstance(credential, str) and credential:
            issuer = credential_issuer(state, self.configured_url)
            if issuer is None or not same_backend(issuer, self.url):
                # The credential goes only to the backend that issued it: never to a typed URL.
                where = mask_url(issuer) if issuer else "a backend this state does not name"
                self.say(f"This node's credential was issued by {where}, not {mask_url(self.url)}, and is not "
                         f"sent there: this is a new join to {mask_url(self.url)} (an administrator there "
                         "approves the code below; the old credential is replaced).")
                credential = None
        if isinstance(credential, str) and credential:
            try:
                self.member = await self.backend.whoami(credential)
            except RouteMissing:
                # An April backend: no whoami (and no join). The stored credential is all there is.
                self.say(f"{mask_url(self.url)} is an older llm-port (no join requests, no whoami); "
                         "this node has a stored credential, so it is started with it.")
                return MEMBER
            except Rejected as e:
                self.say(f"The stored credential is not accepted any more (HTTP {e.status}: the node was "
                         "deleted or its credential revoked); asking to join again.")
            except Transient as e:
                return self.fail(f"cannot reach the backend at {mask_url(self.url)} ({e}); nothing was "
                                 "changed. Check the URL and the network, then run join again.")
            else:
                # The backend's words reach the terminal: bounded, no control characters (escapes).
                agent = shown(str(self.member.get("agent_id") or self.config.agent_id), 200)
                try:
                    node = checked_node_id(self.member.get("node_id"), "the whoami reply")
                except BadNodeId as e:
                    return self.fail(str(e))
                self.say(f"Already a member: this node is {agent} (node {node}) on "
                         f"{mask_url(self.url)}; nothing to approve, no new request. Starting the agent: "
                         "a running one is restarted with this build (an upgrade; state and workloads are kept).")
                self.log.info("join: already a member as node {node_id}", node_id=node)
                return MEMBER
        # Writing the credential while an agent runs on this state would race it.
        self.lock = InstanceLock(self.state_path)
        try:
            await deferToThread(self.lock.acquire)
        except AlreadyRunning as e:
            return self.fail(f"{e} (stop it before joining: sudo systemctl stop llmport-agent)")
        except OSError as e:
            return self.fail(f"cannot create {self.lock.path} ({e.strerror}): run join as root (sudo)")
        try:
            return await self._join(state)
        finally:
            lock, self.lock = self.lock, None
            await deferToThread(lock.release)

    async def _join(self, state: dict[str, Any]) -> int:
        try:
            capabilities = await self.capabilities()
            asked = await self.backend.request_join(self.config.agent_id, self.config.host, capabilities, VERSION)
        except RouteMissing:
            return self.fail(f"{mask_url(self.url)} does not offer joining (an llm-port older than join "
                             f"requests); {TOKEN_START}")
        except Rejected as e:
            if e.status == 429:
                return self.fail(f"the backend has too many machines waiting for approval (HTTP 429: "
                                 f"{e.detail}); approve or reject the waiting ones in llm-port, then run join again")
            return self.fail(f"the backend refused the join request (HTTP {e.status}: {e.detail}); check "
                             "LLM_PORT_NODE_AGENT_AGENT_ID (<= 128 characters) and the URL")
        except Transient as e:
            return self.fail(f"cannot reach the backend at {mask_url(self.url)} ({e}); run join again")
        request_id, code, secret = asked["id"], asked["code"], asked.get("poll_secret")
        saved = state.get("pending_join")
        resumed = False
        if secret:
            await deferToThread(_write_state, self.state_path, {"pending_join": {
                "id": request_id, "backend_url": self.url, "poll_secret": secret,
                "code": code, "expires_at": asked.get("expires_at")}})
        elif (isinstance(saved, dict) and saved.get("id") == request_id
              and saved.get("backend_url") == self.url and isinstance(saved.get("poll_secret"), str)):
            secret, resumed = saved["poll_secret"], True
        self.say("")
        self.say(f"    Join code:  {code}")
        self.say("")
        self.say(f"  In llm-port ({mask_url(self.url)}), approve the machine {self.config.agent_id} and check "
                 "that it shows this code.")
        self.log.info("join: waiting for approval of code {code} (agent id {agent_id}, request {id})",
                      code=code, agent_id=self.config.agent_id, id=request_id)
        if resumed:
            self.say("  Picking up the request an earlier run made; still waiting for it.")
        elif not secret:
            return self.fail(
                f"this machine (agent id {self.config.agent_id}) already asked to join from another run, "
                f"and only that run can collect it: if it is still waiting, approve code {code} there; if it "
                "stopped, reject the request in llm-port and run join again"
            )
        assert isinstance(secret, str)
        return await self._wait(request_id, secret, code)

    async def _wait(self, request_id: str, secret: str, code: str) -> int:
        deadline = self.reactor.seconds() + self.wait_sec
        next_line = self.reactor.seconds() + WAITING_LINE_SEC
        while self.reactor.seconds() < deadline:
            await deferLater(self.reactor, self.poll_sec, lambda: None)
            try:
                result = await self.backend.collect_join(request_id, secret)
            except Rejected as e:
                await self._forget()
                if e.status == 404:
                    return self.fail("the backend no longer knows this join request (HTTP 404: deleted, or "
                                     "the backend's data was reset); run join again for a new code")
                if e.status == 401:
                    return self.fail("the backend refused this run's poll secret (HTTP 401: the request "
                                     "belongs to another run); run join again for a new code")
                return self.fail(f"the backend refused the collect request (HTTP {e.status}: {e.detail}); "
                                 "run join again")
            except Transient as e:
                self.say(f"  (cannot reach the backend: {e}; trying again)")
                continue
            status = result.get("status")
            if status == "pending":
                if self.reactor.seconds() >= next_line:
                    left = max(0.0, deadline - self.reactor.seconds()) / 60
                    self.say(f"  still waiting for approval of code {code} ({left:.0f} min left)")
                    next_line = self.reactor.seconds() + WAITING_LINE_SEC
                continue
            if status == "approved":
                return await self._approved(result)
            await self._forget()
            message = result.get("message")
            why = f" ({shown(message)})" if isinstance(message, str) and message else ""
            if status == "rejected":
                return self.fail(f"an administrator rejected the join request{why}; nothing was stored. "
                                 "Ask them why, then run join again")
            if status == "expired":
                return self.fail(f"the join request expired before anyone approved it{why}; run join again "
                                 "for a new code")
            if status == "claimed":
                return self.fail(f"this join request was already used{why}: its credential went to another "
                                 "run. If this node is not in the fleet, run join again for a new code")
            return self.fail(f"the backend answered the join request with status {shown(repr(status), 40)}; run "
                             "join again")
        return self.fail(f"nobody approved code {code} within {self.wait_sec / 60:.0f} minutes; the request "
                         "is kept: run join again to go on waiting for it")

    async def _forget(self) -> None:
        await deferToThread(_write_state, self.state_path, {"pending_join": None})

    async def _approved(self, result: dict[str, Any]) -> int:
        credential, node_id = result.get("credential"), result.get("node_id")
        if not isinstance(credential, str) or "." not in credential:
            await self._forget()
            return self.fail("the backend approved the join but its reply carries no usable credential; "
                             "run join again (or use an enrollment token)")
        try:
            node_id = checked_node_id(node_id, "the approved join's reply")
        except BadNodeId as e:
            await self._forget()
            return self.fail(str(e))
        now = self.wallclock()
        host = result.get("host")
        await deferToThread(_write_state, self.state_path, {
            "credential": credential, "node_id": node_id, "agent_id": self.config.agent_id,
            # Its issuer: the credential goes to no other backend (join, start).
            "backend_url": self.url,
            "backend_host": host if isinstance(host, str) else None,
            "enrolled_at": now, "last_rotation_at": now, "pending_join": None,
            "previous_credential": None, "pending_credential": None, "refusals": None,
        })
        self.say(f"Approved: this machine is node {node_id} (agent id {self.config.agent_id}); the "
                 f"credential is stored in {self.state_path} (mode 0600).")
        self.log.info("join: approved as node {node_id}", node_id=node_id)
        return JOINED

"""
`llmport-agent join [URL]` (issue 20 #1, protocol 10.7) against the real stand-in backend on
loopback: the code, approval through the admin HTTP API, every other outcome in one line
(rejected, expired, claimed, 429, 404, 401, an April backend), the pending join kept in the state
file and resumed by the next run, "already a member" through whoami with no new request; and the
console script end to end, handing over to `start` (a stand-in systemctl).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest

from llmport_agent.agent.service import make_http_client
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend
from llmport_agent.host.installer import unstable_place
from llmport_agent.host.join import Joiner
from llmport_agent.session.backend_http import BackendHTTP
from tests.agentharness import AgentTestCase, agent_env
from tests.test_installer import Host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JoinHelpers(AgentTestCase):
    timeout = 60

    async def backend(self, **kw: Any) -> DevBackend:
        b = DevBackend(reactor, **kw)
        self.watch_backend(b)
        await b.listen(0, "127.0.0.1")
        self.addCleanup(b.stop)
        return b

    def joiner(self, b: DevBackend, state_dir: str | None = None, agent_id: str = "gpu-07",
               wait: float = 20.0, configured: str | None = "") -> Joiner:
        """C{configured}: the env file's BACKEND_URL before this join (default: C{b}'s, as a node of it has)."""
        d = os.path.abspath(state_dir or self.mktemp())
        os.makedirs(d, exist_ok=True)
        config = load_config(agent_env(b, d, AGENT_ID=agent_id), {})
        http, pool = make_http_client(reactor, config)
        self.addCleanup(pool.closeCachedConnections)
        backend = BackendHTTP(reactor, http, config.backend_url, 5.0)
        j = Joiner(reactor, config, backend, config.state_path, lambda: succeed({"hostname": agent_id}),
                   io.StringIO(), io.StringIO(), poll_sec=0.05, wait_sec=wait,
                   configured_url=b.url if configured == "" else configured)
        return j

    def text(self, j: Joiner) -> str:
        return j.out.getvalue() + j.err.getvalue()  # type: ignore[attr-defined]

    def state(self, j: Joiner) -> dict[str, Any]:
        with open(j.state_path) as f:
            data: dict[str, Any] = json.load(f)
        return data

    async def pending(self, b: DevBackend, j: Joiner | None = None) -> Any:
        """The request filed, and (with C{j}) its reply arrived (the code printed, the secret stored)."""
        await b.wait_for(lambda: bool(b.onboarding.pending()) and (
            j is None or "Join code:" in j.out.getvalue()), 10)  # type: ignore[attr-defined]
        return b.onboarding.pending()[0]

    async def admin(self, b: DevBackend, ident: str, action: str, message: str | None = None) -> int:
        response = await treq.post(f"{b.url}/api/admin/system/nodes/join-requests/{ident}/{action}",
                                   json={"message": message} if message else {}, persistent=False)
        await response.content()
        return int(response.code)



class JoinTests(JoinHelpers):
    async def test_approved_through_the_admin_api(self) -> None:
        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        self.assertRegex(row.code, r"^[A-Z0-9]{3}-[A-Z0-9]{3}$")
        self.assertIn(f"Join code:  {row.code}", j.out.getvalue())  # type: ignore[attr-defined]
        # The pending join is on disk (the original's key) before anyone approves.
        saved = self.state(j)["pending_join"]
        self.assertEqual((saved["id"], saved["backend_url"]), (row.id, b.url))
        listed = await (await treq.get(f"{b.url}/api/admin/system/nodes/join-requests", persistent=False)).json()
        self.assertEqual([r["code"] for r in listed], [row.code])
        self.assertEqual(await self.admin(b, row.code.lower().replace("-", ""), "approve"), 200)
        self.assertEqual(await d, 0)
        state = self.state(j)
        self.assertNotIn("pending_join", state)
        node = b.node_by_agent_id("gpu-07")
        self.assertEqual(state["node_id"], node["id"])
        self.assertEqual(b.state.authenticate(f"Bearer {state['credential']}")[0].id, node["id"])
        self.assertEqual(os.stat(j.state_path).st_mode & 0o777, 0o600)
        self.assertNotIn(state["credential"].split(".")[1], self.text(j))
        self.assertNotIn(saved["poll_secret"], self.text(j))

    async def test_a_rerun_resumes_the_pending_join(self) -> None:
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        first = self.joiner(b, d, wait=0.3)
        self.assertEqual(await first.run(), 1)
        self.assertIn("the request is kept: run join again", first.err.getvalue())  # type: ignore[attr-defined]
        self.assertIn("pending_join", self.state(first))
        second = self.joiner(b, d)
        run = ensureDeferred(second.run())
        await b.wait_for(lambda: "Picking up the request" in second.out.getvalue(), 10)  # type: ignore[attr-defined]
        self.assertEqual(len(b.onboarding.requests), 1)
        row = b.onboarding.pending()[0]
        self.assertIn(row.code, second.out.getvalue())  # type: ignore[attr-defined]
        self.assertEqual(await self.admin(b, row.id, "approve"), 200)
        self.assertEqual(await run, 0)
        self.assertIn("credential", self.state(second))

    async def test_rejected(self) -> None:
        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        self.assertEqual(await self.admin(b, row.id, "reject", "not one of ours"), 200)
        self.assertEqual(await d, 1)
        lines = j.err.getvalue().splitlines()  # type: ignore[attr-defined]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("rejected the join request (not one of ours)", lines[0])
        self.assertNotIn("pending_join", self.state(j))
        self.assertNotIn("credential", self.state(j))

    async def test_backend_words_shown_without_control_characters(self) -> None:
        """
        A rejection message with a terminal escape sequence and a forged second line reaches
        the operator as one bounded line; a backend error detail is bounded and cleaned too.
        """
        from llmport_agent.session.backend_http import _detail

        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        hostile = "\x1b]0;owned\x07\x1b[2Jok\nllmport-agent: approved as node 1" + "x" * 5000
        self.assertEqual(await self.admin(b, row.id, "reject", hostile), 200)
        self.assertEqual(await d, 1)
        lines = j.err.getvalue().splitlines()  # type: ignore[attr-defined]
        self.assertEqual(len(lines), 1, lines)
        self.assertNotIn("\x1b", lines[0])
        self.assertLess(len(lines[0]), 600)
        detail = _detail(json.dumps({"detail": "\x1b[31mred\r\nforged" + "y" * 9000}).encode())
        self.assertEqual(len(detail), 300)
        self.assertTrue(detail.startswith("?[31mred??forged"), detail[:40])

    async def test_expired(self) -> None:
        clock = Clock()
        clock.advance(1_000_000)
        b = await self.backend(clock=clock)
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        await self.pending(b, j)
        clock.advance(16 * 60)
        self.assertEqual(await d, 1)
        self.assertIn("expired before anyone approved it", j.err.getvalue())  # type: ignore[attr-defined]
        self.assertNotIn("pending_join", self.state(j))

    async def test_rejected_with_the_devbackend_cli(self) -> None:
        from twisted.internet.threads import deferToThread

        from llmport_agent.devbackend.cli import main as devbackend_main

        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        self.assertEqual(await deferToThread(devbackend_main, ["join-requests", "--url", b.url]), 0)
        self.assertEqual(await deferToThread(devbackend_main, ["approve", "NOPE-00", "--url", b.url]), 1)
        self.assertEqual(await deferToThread(
            devbackend_main, ["reject", row.code, "--message", "wrong rack", "--url", b.url]), 0)
        self.assertEqual(await d, 1)
        self.assertIn("rejected the join request (wrong rack)", j.err.getvalue())  # type: ignore[attr-defined]

    async def test_claimed_by_another_run(self) -> None:
        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        b.onboarding.decide(row.id, True)
        # Another run holding the secret collects first.
        b.onboarding.collect(row.id, self.state(j)["pending_join"]["poll_secret"], "127.0.0.1")
        self.assertEqual(await d, 1)
        self.assertIn("already used", j.err.getvalue())  # type: ignore[attr-defined]

    async def test_too_many_pending_is_429(self) -> None:
        b = await self.backend()
        for n in range(3):
            b.onboarding.request_join(f"other-{n}", None, {}, None, "127.0.0.1")
        j = self.joiner(b)
        self.assertEqual(await j.run(), 1)
        err = j.err.getvalue()  # type: ignore[attr-defined]
        self.assertIn("too many machines waiting for approval (HTTP 429", err)
        self.assertEqual(len(err.splitlines()), 1)
        self.assertNotIn("pending_join", self.state(j) if os.path.exists(j.state_path) else {})

    async def test_request_gone_is_404(self) -> None:
        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        del b.onboarding.requests[row.id]
        self.assertEqual(await d, 1)
        self.assertIn("no longer knows this join request (HTTP 404", j.err.getvalue())  # type: ignore[attr-defined]
        self.assertNotIn("pending_join", self.state(j))

    async def test_wrong_poll_secret_is_401(self) -> None:
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        first = self.joiner(b, d, wait=0.2)
        self.assertEqual(await first.run(), 1)
        state = self.state(first)
        state["pending_join"]["poll_secret"] = "not-the-secret"
        with open(first.state_path, "w") as f:
            json.dump(state, f)
        second = self.joiner(b, d)
        self.assertEqual(await second.run(), 1)
        self.assertIn("refused this run's poll secret (HTTP 401", second.err.getvalue())  # type: ignore[attr-defined]
        self.assertNotIn("not-the-secret", self.text(second))

    async def test_waiting_elsewhere_without_the_secret(self) -> None:
        b = await self.backend()
        row = b.onboarding.request_join("gpu-07", None, {}, None, "127.0.0.1")
        j = self.joiner(b)
        self.assertEqual(await j.run(), 1)
        self.assertIn(f"approve code {row['code']} there", j.err.getvalue())  # type: ignore[attr-defined]

    async def test_already_a_member_files_no_request(self) -> None:
        b = await self.backend()
        reply = b.enroll_node("gpu-07")
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        j = self.joiner(b, d)
        self.assertEqual(await j.run(), 0)
        self.assertIn("Already a member", j.out.getvalue())  # type: ignore[attr-defined]
        self.assertIn(reply["node_id"], j.out.getvalue())  # type: ignore[attr-defined]
        self.assertEqual(b.onboarding.requests, {})

    async def test_deleted_node_asks_again(self) -> None:
        b = await self.backend()
        reply = b.enroll_node("gpu-07")
        b.state.delete_node(reply["node_id"])
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"], "workloads": {"r": {}}}, f)
        j = self.joiner(b, d)
        run = ensureDeferred(j.run())
        row = await self.pending(b, j)
        self.assertIn("not accepted any more (HTTP 401", j.out.getvalue())  # type: ignore[attr-defined]
        b.onboarding.decide(row.id, True)
        self.assertEqual(await run, 0)
        state = self.state(j)
        self.assertNotEqual(state["credential"], reply["credential"])
        self.assertEqual(state["workloads"], {"r": {}})  # the original's keys are kept

    async def test_april_backend(self) -> None:
        b = await self.backend()
        b.onboarding.enabled = False
        j = self.joiner(b)
        self.assertEqual(await j.run(), 1)
        err = j.err.getvalue()  # type: ignore[attr-defined]
        self.assertIn("does not offer joining", err)
        self.assertIn("ENROLLMENT_TOKEN", err)
        # With a stored credential there is nothing to ask: start with it.
        reply = b.enroll_node("gpu-08")
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        self.assertEqual(await self.joiner(b, d, agent_id="gpu-08").run(), 0)

    async def test_refused_while_an_agent_holds_the_state(self) -> None:
        from llmport_agent.host.instance import InstanceLock

        b = await self.backend()
        j = self.joiner(b)
        lock = InstanceLock(j.state_path)
        lock.acquire()
        self.addCleanup(lock.release)
        self.assertEqual(await j.run(), 1)
        self.assertIn(f"process {os.getpid()} holds", j.err.getvalue())  # type: ignore[attr-defined]
        self.assertEqual(b.onboarding.requests, {})


class JoinCommandTests(AgentTestCase):
    """The console script: join, approve, then `start` (stand-in systemctl under a fake root)."""

    timeout = 90

    async def test_join_then_start(self) -> None:
        script = os.path.join(os.path.dirname(sys.executable), "llmport-agent")
        if not os.access(script, os.X_OK):
            script = shutil.which("llmport-agent") or sys.executable
        place = unstable_place(script)
        if place:
            raise SkipTest(f"the agent's executable {script} is under {place}, where start rightly refuses "
                           "to install it: run the tests from a venv outside /tmp")
        b = DevBackend(reactor)
        self.watch_backend(b)
        await b.listen(0, "127.0.0.1")
        self.addCleanup(b.stop)
        h = Host(self)
        env_file = os.path.join(h.root, "etc/llmport-agent.env")
        with open(env_file, "w") as f:
            f.write("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN=old-token\n")
        env = dict(os.environ, PYTHONPATH=ROOT, LLMPORT_AGENT_SYSTEM_ROOT=h.root,
                   PATH=h.bin + os.pathsep + os.environ.get("PATH", ""), SYSTEMCTL_LOG=h.log,
                   SYSTEMCTL_FAIL="", SYSTEMCTL_ACTIVE="",
                   LLM_PORT_NODE_AGENT_AGENT_ID="gpu-09", LLM_PORT_NODE_AGENT_HOST="127.0.0.1",
                   LLM_PORT_NODE_AGENT_GPU_SOURCE="none", LLM_PORT_NODE_AGENT_LOG_FORMAT="text")
        env.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN", None)
        log = os.path.join(h.root, "join.log")
        out = open(log, "wb")
        self.addCleanup(out.close)
        hostport = b.url.split("://", 1)[1]  # as a person types it
        proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "join", "--insecure-http", hostport], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        await b.wait_for(lambda: bool(b.onboarding.pending()) or proc.poll() is not None, 30)
        row = b.onboarding.pending()[0]
        await b.wait_for(lambda: row.code in open(log).read(), 10)
        b.onboarding.decide(row.code, True)
        await b.wait_for(lambda: proc.poll() is not None, 40)
        text = open(log).read()
        self.assertEqual(proc.returncode, 0, text[-3000:])
        self.assertIn("Approved: this machine is node", text)
        self.assertIn("restart llmport-agent.service", h.calls())
        values = open(env_file).read()
        self.assertIn(f"LLM_PORT_NODE_AGENT_BACKEND_URL={b.url}", values)
        self.assertNotIn("old-token", values)
        with open(os.path.join(h.root, "var/lib/llmport-agent/state.json")) as f:
            self.assertEqual(json.load(f)["node_id"], b.node_by_agent_id("gpu-09")["id"])

        # Again: already a member, no new request, `start` again (an upgrade restarts the unit).
        before = len(b.onboarding.requests)
        log2 = os.path.join(h.root, "again.log")
        out2 = open(log2, "wb")
        self.addCleanup(out2.close)
        again = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "join", b.url], cwd=ROOT, env=env,
                                 stdout=out2, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: again.poll() is None and (again.kill(), again.wait()))
        await b.wait_for(lambda: again.poll() is not None, 40)
        text = open(log2).read()
        self.assertEqual(again.returncode, 0, text[-3000:])
        self.assertIn("Already a member", text)
        self.assertEqual(len(b.onboarding.requests), before)
        self.assertEqual(h.calls().count("restart llmport-agent.service"), 2)


class Stranger:
    """
    A server that is not the node's backend, on loopback: it records every request (path, its
    Authorization header, its body) and answers whoami with 200 (as a hostile one would, to be
    believed), a join request with C{join_reply}, a collect with "pending", anything else 404.
    """

    def __init__(self, join_reply: dict[str, Any] | None = None) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        self.join_reply = join_reply
        self.port: Any = None

    def start(self, test: Any) -> str:
        from twisted.web import resource, server

        stranger = self

        class Everything(resource.Resource):
            isLeaf = True

            def render(self, request: Any) -> bytes:
                path = request.path.decode()
                auth = (request.getHeader("authorization") or "")
                body = request.content.read()
                stranger.seen.append((path, auth, body))
                request.setHeader("content-type", "application/json")
                if path.endswith("/whoami"):
                    return json.dumps({"node_id": "evil-node", "agent_id": "gpu-07"}).encode()
                if path.endswith("/join-requests") and stranger.join_reply is not None:
                    return json.dumps(stranger.join_reply).encode()
                if path.endswith("/collect"):
                    return json.dumps({"status": "pending"}).encode()
                request.setResponseCode(404)
                return b'{"detail": "Not Found"}'

        self.port = reactor.listenTCP(0, server.Site(Everything()), interface="127.0.0.1")
        test.addCleanup(self.port.stopListening)
        return f"http://127.0.0.1:{self.port.getHost().port}"

    def saw(self, secret: str) -> bool:
        return any(secret in auth or secret.encode() in body for _, auth, body in self.seen)


class CredentialStaysWithItsIssuerTests(JoinHelpers):
    """
    Issue 29 #1: the credential goes only to the backend that issued it (recorded in the state
    file, else the env file's BACKEND_URL); another URL is a new join, said in one line.
    """

    def stranger_joiner(self, b: DevBackend, url: str, state: dict[str, Any], configured: str | None) -> Joiner:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump(state, f)
        config = load_config(agent_env(b, d, AGENT_ID="gpu-07", BACKEND_URL=url), {})
        http, pool = make_http_client(reactor, config)
        self.addCleanup(pool.closeCachedConnections)
        return Joiner(reactor, config, BackendHTTP(reactor, http, url, 5.0), config.state_path,
                      lambda: succeed({"hostname": "gpu-07"}), io.StringIO(), io.StringIO(), poll_sec=0.05,
                      wait_sec=0.3, configured_url=configured)

    async def test_a_stranger_answering_whoami_never_sees_the_credential(self) -> None:
        b = await self.backend()
        reply = b.enroll_node("gpu-07")
        stranger = Stranger()
        url = stranger.start(self)
        j = self.stranger_joiner(b, url, {"credential": reply["credential"], "node_id": reply["node_id"],
                                          "backend_url": b.url}, configured=b.url)
        self.assertEqual(await j.run(), 1)  # the stranger offers no joining
        self.assertFalse(stranger.saw(reply["credential"]), stranger.seen)
        self.assertFalse(stranger.saw(reply["credential"].split(".")[-1]), stranger.seen)
        self.assertNotIn("/api/node-files/whoami", [p for p, _, _ in stranger.seen])
        self.assertNotIn("Already a member", self.text(j))
        self.assertIn(f"issued by {b.url}, not {url}, and is not sent there: this is a new join", self.text(j))
        # Nothing of the old membership was dropped.
        self.assertEqual(self.state(j)["credential"], reply["credential"])

    async def test_a_legacy_state_is_judged_by_the_configured_url(self) -> None:
        """No recorded issuer (a state of the original agent): the env file's BACKEND_URL issued it."""
        b = await self.backend()
        reply = b.enroll_node("gpu-07")
        stranger = Stranger()
        url = stranger.start(self)
        legacy = {"credential": reply["credential"], "node_id": reply["node_id"]}
        j = self.stranger_joiner(b, url, legacy, configured=b.url)
        await j.run()
        self.assertFalse(stranger.saw(reply["credential"]), stranger.seen)
        # Neither recorded nor configured: unknown, so never sent either.
        j = self.stranger_joiner(b, url, legacy, configured=None)
        await j.run()
        self.assertFalse(stranger.saw(reply["credential"]), stranger.seen)
        self.assertIn("issued by a backend this state does not name", self.text(j))

    async def test_the_same_backend_is_still_a_member(self) -> None:
        """The recorded issuer, written differently (case, default port, a trailing /), is the same backend."""
        b = await self.backend()
        reply = b.enroll_node("gpu-07")
        host_port = b.url.split("://", 1)[1]
        j = self.stranger_joiner(b, b.url + "/", {"credential": reply["credential"], "node_id": reply["node_id"],
                                                  "backend_url": "HTTP://" + host_port.upper()}, configured=None)
        self.assertEqual(await j.run(), 0)
        self.assertIn("Already a member", self.text(j))

    async def test_an_approved_join_records_its_issuer(self) -> None:
        b = await self.backend()
        j = self.joiner(b)
        d = ensureDeferred(j.run())
        row = await self.pending(b, j)
        b.onboarding.decide(row.id, True)
        self.assertEqual(await d, 0)
        self.assertEqual(self.state(j)["backend_url"], b.url)

    async def test_a_saved_poll_secret_is_not_sent_to_another_backend(self) -> None:
        """
        A pending join saved for backend A; B answers the join request with the same id and no
        poll secret (as a backend does for a request it already handed one out for): the saved
        secret is A's, never sent to B.
        """
        b = await self.backend()
        stranger = Stranger(join_reply={"id": "req-1", "code": "ABC-DEF"})
        url = stranger.start(self)
        secret = "a-poll-secret-of-backend-a-0123456789"
        j = self.stranger_joiner(b, url, {"pending_join": {"id": "req-1", "backend_url": b.url,
                                                           "poll_secret": secret, "code": "ABC-DEF"}},
                                 configured=None)
        self.assertEqual(await j.run(), 1)
        self.assertFalse(stranger.saw(secret), stranger.seen)
        self.assertNotIn("/api/admin/system/nodes/join-requests/req-1/collect", [p for p, _, _ in stranger.seen])
        self.assertIn("only that run can collect it", self.text(j))

    async def test_a_node_id_that_is_not_one_is_refused(self) -> None:
        """Issue 29 #4: an approved join naming a node id with escapes, or too long, stores nothing."""
        b = await self.backend()
        for bad in ("n\x1b[2J\x1b]0;pwned\x07", "x" * 129, "a/../../etc", "", "\u202eevil"):
            j = self.joiner(b)
            code = await j._approved({"credential": "00000000-0000-0000-0000-000000000000.abc", "node_id": bad})
            self.assertEqual(code, 1)
            err = j.err.getvalue()  # type: ignore[attr-defined]
            self.assertIn("that is not one", err)
            self.assertEqual(len(err.strip().splitlines()), 1)
            self.assertNotIn("\x1b", err)
            self.assertNotIn("\u202e", err)
            self.assertFalse(os.path.exists(j.state_path) and "credential" in self.state(j))


class JoinURLTests(AgentTestCase):
    """What a typed URL becomes: https unless the operator says otherwise; never a silent http."""

    def test_bare_host_port_is_https(self) -> None:
        from llmport_agent.host.join import normalise_url

        self.assertEqual(normalise_url("10.0.0.5:8000"), "https://10.0.0.5:8000")
        self.assertEqual(normalise_url(" llm.example "), "https://llm.example")
        self.assertEqual(normalise_url("10.0.0.5:8000", insecure_http=True), "http://10.0.0.5:8000")

    def test_http_needs_consent(self) -> None:
        from llmport_agent.host.join import InsecureURL, normalise_url

        with self.assertRaises(InsecureURL) as e:
            normalise_url("http://10.0.0.5:8000")
        self.assertIn("--insecure-http", str(e.exception))
        self.assertEqual(normalise_url("http://10.0.0.5:8000", insecure_http=True), "http://10.0.0.5:8000")
        # The URL this node is already configured for exposes nothing new.
        self.assertEqual(normalise_url("http://10.0.0.5:8000/", known=("http://10.0.0.5:8000",)),
                         "http://10.0.0.5:8000/")
        with self.assertRaises(InsecureURL):
            normalise_url("http://10.0.0.6:8000", known=("http://10.0.0.5:8000",))
        with self.assertRaises(InsecureURL):
            normalise_url("ftp://10.0.0.5")
        self.assertEqual(normalise_url("https://10.0.0.5"), "https://10.0.0.5")

    def test_same_backend(self) -> None:
        from llmport_agent.host.join import same_backend

        self.assertTrue(same_backend("https://LLM.example/", "https://llm.example:443"))
        self.assertTrue(same_backend("http://a:80/x/", "http://a/x"))
        self.assertFalse(same_backend("http://a:8000", "https://a:8000"))
        self.assertFalse(same_backend("http://a:8000", "http://a:8001"))
        self.assertFalse(same_backend("http://a:8000", "http://a.evil:8000"))
        self.assertFalse(same_backend("http://a:8000/x", "http://a:8000/y"))

"""
`llmport-agent doctor` in scripted broken environments (issue 22, point 3), each named with the
fix it must print: no engine, wrong CA, an expired token, a store on a full or read-only file
system, an env file 0644 with the token, a port Ray needs taken, a deleted node; checks run
concurrently, each bounded; a running agent next to it keeps its one stream and its state;
the exit status follows the worst finding.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from llmport_agent.devbackend import make_test_tls
from llmport_agent.doctor import checks as C
from llmport_agent.doctor.result import FAIL, OK, WARN, Finding, exit_status, fail, ok, warn
from llmport_agent.doctor.run import diagnose, main, make_context, read_env_file
from llmport_agent.ops.endpoint import OpsService
from tests.agentharness import AgentTestCase, agent_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctx_for(case: Any, env: dict[str, str] | None = None, env_file: str | None = None, **kw: Any) -> C.Context:
    d = os.path.abspath(case.mktemp())
    os.makedirs(d, exist_ok=True)
    base = {
        "LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(d, "state", "state.json"),
        "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(d, "models"),
        "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
    }
    base.update(env or {})
    return make_context(env_file or os.path.join(d, "absent.env"), base, **kw)


def by_check(findings: list[Finding], name: str) -> list[Finding]:
    return [f for f in findings if f.check == name]


def one(case: Any, findings: list[Finding], name: str, status: str) -> Finding:
    mine = by_check(findings, name)
    case.assertEqual([f.status for f in mine], [status], [f.line() for f in findings])
    return mine[0]


class ResultTests(SynchronousTestCase):
    def test_exit_status_by_the_worst(self) -> None:
        self.assertEqual(exit_status([]), 0)
        self.assertEqual(exit_status([ok("a", "x"), ok("b", "y")]), 0)
        self.assertEqual(exit_status([ok("a", "x"), warn("b", "y", "z")]), 1)
        self.assertEqual(exit_status([warn("b", "y", "z"), fail("c", "y", "z"), ok("a", "x")]), 2)

    def test_a_line_carries_no_control_character(self) -> None:
        """What a check quotes (a backend's, a loopback listener's words) reaches the terminal inert."""
        self.assertEqual(fail("gpu health", "GPU 0\x1b]0;owned\x07 bad\nfake line", "do\x9bx").line(),
                         "fail  gpu health          GPU 0?]0;owned? bad?fake line -> do?x")

    def test_line_names_the_fix(self) -> None:
        self.assertEqual(fail("env file", "mode 0644", "`chmod 600 f`").line(),
                         "fail  env file            mode 0644 -> `chmod 600 f`")
        self.assertEqual(ok("rdma", "none").line(), "ok    rdma                none")

    def test_env_file_parsing(self) -> None:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("# c\nLLM_PORT_NODE_AGENT_BACKEND_URL=\"https://b.example\"\n\nX='1'\nbad line\n")
        self.assertEqual(read_env_file(path), {"LLM_PORT_NODE_AGENT_BACKEND_URL": "https://b.example", "X": "1"})


class EngineTests(SynchronousTestCase):
    def test_no_engine(self) -> None:
        ctx = ctx_for(self, {"DOCKER_HOST": "unix://" + os.path.abspath(self.mktemp()) + ".sock"})
        f = one(self, C.check_engine(ctx), "docker engine", FAIL)
        # The agent's own words (its log says the same), not a raw Python exception (issue 26).
        self.assertIn("Docker engine at unix://", f.detail)
        self.assertIn("is unreachable: the socket does not exist (is dockerd running?)", f.detail)
        self.assertNotIn("Errno", f.detail)
        self.assertNotIn("Error(", f.detail)
        self.assertIn("systemctl start docker", f.fix)
        self.assertIn("DOCKER_HOST", f.fix)

    def test_the_same_words_as_the_agents_log(self) -> None:
        """doctor's line is what the agent's engine says for the same failure (translate_error)."""
        from llmport_agent.workloads.engine import translate_error

        address = "tcp://127.0.0.1:9"  # nothing listens there: connection refused
        f = one(self, C.check_engine(ctx_for(self, {"DOCKER_HOST": address})), "docker engine", FAIL)
        self.assertIn("connection refused (is dockerd running?)", f.detail)
        agent_words = str(translate_error("x", address, ConnectionRefusedError(111, "Connection refused"),
                                          3)).split(" failed: ", 1)[1]
        self.assertEqual(f.detail, agent_words)

    def test_real_engine(self) -> None:
        from tests.support.docker_env import require_docker

        env = require_docker()
        f = one(self, C.check_engine(ctx_for(self, {"DOCKER_HOST": env.host})), "docker engine", OK)
        self.assertRegex(f.detail, r"^\d+\.\d+.* \(API 1\.\d+\) at unix://")


class FileTests(SynchronousTestCase):
    def test_env_file_0644_with_the_token(self) -> None:
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as f:
            f.write("LLM_PORT_NODE_AGENT_BACKEND_URL=http://127.0.0.1:9\nLLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN=abc\n")
        os.chmod(path, 0o644)
        ctx = ctx_for(self, env_file=path)
        self.assertEqual(ctx.config.enrollment_token, "abc")  # type: ignore[union-attr]
        f = one(self, C.check_files(ctx), "env file", FAIL)
        self.assertIn("ENROLLMENT_TOKEN", f.detail)
        self.assertIn("0644", f.detail)
        self.assertEqual(f.fix, f"`sudo chmod 600 {path}`")
        self.assertNotIn("abc", f.line())
        os.chmod(path, 0o600)
        one(self, C.check_files(ctx), "env file", OK)

    def test_state_directory_open_to_others(self) -> None:
        ctx = ctx_for(self)
        state_dir = os.path.dirname(ctx.config.state_path)  # type: ignore[union-attr]
        os.makedirs(state_dir)
        os.chmod(state_dir, 0o777)
        f = one(self, C.check_files(ctx), "state directory", FAIL)
        self.assertEqual(f.fix, f"`chmod 700 {state_dir}`")
        os.chmod(state_dir, 0o700)
        one(self, C.check_files(ctx), "state directory", OK)

    def test_tls_client_key_open_to_others(self) -> None:
        """The node's mTLS private key readable by other users is a failure naming the chmod."""
        from tests.test_tls_client import make_client_pki

        pki = make_client_pki(os.path.abspath(self.mktemp()))
        for env, path in (({"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT": pki["cert"],
                            "LLM_PORT_NODE_AGENT_TLS_CLIENT_KEY": pki["key"]}, pki["key"]),
                          ({"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT": pki["both"]}, pki["both"])):
            ctx = ctx_for(self, env)
            os.chmod(path, 0o644)
            f = one(self, C.check_files(ctx), "tls client key", FAIL)
            self.assertIn("0644", f.detail)
            self.assertEqual(f.fix, f"`sudo chmod 600 {path}`")
            self.assertNotIn("PRIVATE KEY", f.line())
            # Group-readable only (0640, 0604) is open to other users too.
            for mode in (0o640, 0o604, 0o660):
                os.chmod(path, mode)
                f = one(self, C.check_files(ctx), "tls client key", FAIL)
                self.assertIn(f"{mode:04o}", f.detail)
            os.chmod(path, 0o600)
            one(self, C.check_files(ctx), "tls client key", OK)
        self.assertEqual(by_check(C.check_files(ctx_for(self)), "tls client key"), [])

    def test_loki_never_gets_the_backend_client_certificate(self) -> None:
        """The doctor's push to Loki (another server) presents no client certificate, as the agent's."""
        import ssl

        from tests.test_tls_client import make_client_pki

        pki = make_client_pki(os.path.abspath(self.mktemp()))
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT": pki["cert"],
                             "LLM_PORT_NODE_AGENT_TLS_CLIENT_KEY": pki["key"],
                             "LLM_PORT_NODE_AGENT_LOKI_URL": "https://127.0.0.1:9"})
        loaded: list[Any] = []
        real = ssl.SSLContext.load_cert_chain
        self.patch(ssl.SSLContext, "load_cert_chain",
                   lambda context, *a, **kw: (loaded.append(a), real(context, *a, **kw))[1])
        f = one(self, C.check_loki(ctx), "loki", FAIL)
        self.assertIn("did not answer", f.detail)
        self.assertEqual(loaded, [])
        C._tls_context(ctx, True)  # the backend's context still carries it
        self.assertEqual(loaded, [(pki["cert"], pki["key"])])

    def test_store_with_a_link_out(self) -> None:
        ctx = ctx_for(self)
        store = ctx.config.model_store  # type: ignore[union-attr]
        os.makedirs(os.path.join(store, "models--a"))
        os.symlink("/etc", os.path.join(store, "models--a", "evil"))
        os.symlink("models--a", os.path.join(store, "inside"))
        found = C.check_model_store(ctx)
        links = [f for f in found if "links leading out" in f.detail]
        self.assertEqual(len(links), 1, [f.line() for f in found])
        self.assertIn("models--a/evil", links[0].detail)
        self.assertNotIn("inside", links[0].detail)

    def _mount(self, *args: str) -> None:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SkipTest(f"cannot mount here ({done.stderr.strip()[:100]})")

    def _umount(self, path: str) -> None:
        subprocess.run(["umount", "-l", path], capture_output=True, check=False)

    def test_store_on_a_full_file_system(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("mounting a tmpfs needs root")
        ctx = ctx_for(self)
        store = ctx.config.model_store  # type: ignore[union-attr]
        os.makedirs(store)
        self._mount("-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", store)
        self.addCleanup(self._umount, store)
        with open(os.path.join(store, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        f2 = one(self, C.check_model_store(ctx), "model store", FAIL)
        self.assertIn("GiB free", f2.detail)
        self.assertIn("free space", f2.fix)

    def test_store_on_a_read_only_file_system(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("a read-only bind mount needs root")
        ctx = ctx_for(self)
        store = ctx.config.model_store  # type: ignore[union-attr]
        os.makedirs(store)
        self._mount("--bind", store, store)
        self.addCleanup(self._umount, store)
        self._mount("-o", "remount,bind,ro", store)
        f = one(self, C.check_model_store(ctx), "model store", FAIL)
        self.assertIn("read-only file system", f.detail)
        self.assertIn("mount it read-write", f.fix)


class PortTests(SynchronousTestCase):
    def test_a_port_ray_needs_is_taken(self) -> None:
        holder = socket.socket()
        self.addCleanup(holder.close)
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        ctx = ctx_for(self, ray_ports=(port,))
        f = one(self, C.check_ray_ports(ctx), "ray ports", WARN)
        self.assertIn(f"{port} by ", f.detail)
        self.assertIn(f"pid {os.getpid()}", f.detail)
        self.assertIn("stop what holds them", f.fix)
        holder.close()
        one(self, C.check_ray_ports(ctx), "ray ports", OK)
        self.assertEqual(C.RAY_PORTS, (6379, 8000, 8265, 8089))


class BoundsTests(TestCase):
    #: The hung check is cut off at 0.5 s: a run that waited for it would pass this bound.
    timeout = 8
    async def test_checks_run_concurrently_and_a_hung_one_is_cut_off(self) -> None:
        """Two checks meet at a barrier (only possible at once); a third never returns: fail, bounded."""
        barrier = threading.Barrier(2, timeout=30)
        release = threading.Event()
        self.addCleanup(release.set)

        def meets(ctx: C.Context) -> list[Finding]:
            barrier.wait()
            return [ok("meet", "met")]

        def hangs(ctx: C.Context) -> list[Finding]:
            release.wait()
            return [ok("hung", "never")]

        ctx = ctx_for(self)
        ctx.readiness = {}
        findings = await diagnose(reactor, ctx, [("a", meets), ("b", meets), ("hung", hangs)], limit=0.5)
        self.assertEqual([f.line() for f in findings[:2]], ["ok    meet                met"] * 2)
        self.assertEqual((findings[2].check, findings[2].status), ("hung", FAIL))
        self.assertIn("did not finish within 0.5 s", findings[2].detail)
        self.assertTrue(findings[2].fix)

    async def test_a_check_that_raises_is_one_failed_line(self) -> None:
        def broken(ctx: C.Context) -> list[Finding]:
            raise RuntimeError("boom")

        ctx = ctx_for(self)
        ctx.readiness = {}
        findings = await diagnose(reactor, ctx, [("broken", broken)])
        self.assertEqual([(f.check, f.status) for f in findings], [("broken", FAIL)])
        self.assertIn("RuntimeError: boom", findings[0].detail)


class BackendTests(AgentTestCase):
    timeout = 120

    async def run_doctor(self, ctx: C.Context) -> list[Finding]:
        return await diagnose(reactor, ctx, [("backend", C.check_backend), ("credential", C.check_credential)])

    async def test_wrong_ca(self) -> None:
        """A backend whose CA is not trusted: names the issuer and CA_BUNDLE; with the CA it passes."""
        tls = make_test_tls(self.mktemp())
        backend = await self.start_backend(tls=tls)
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url})
        findings = await self.run_doctor(ctx)
        one(self, findings, "backend dns", OK)
        one(self, findings, "backend tcp", OK)
        f = one(self, findings, "backend tls", FAIL)
        self.assertIn("not trusted", f.detail)
        self.assertIn("llmport-agent devbackend test CA", f.detail)
        self.assertIn("LLM_PORT_NODE_AGENT_CA_BUNDLE", f.fix)
        good = ctx_for(self, {"LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
                              "LLM_PORT_NODE_AGENT_CA_BUNDLE": str(tls.ca_pem)})
        findings = await self.run_doctor(good)
        one(self, findings, "backend tls", OK)
        one(self, findings, "clock", OK)

    async def test_expired_token(self) -> None:
        """The agent tried a token the backend rejected (expired): the doctor says to mint a new one."""
        backend = await self.start_backend(token_ttl=0.05)
        token = backend.mint_token("expires")["token"]
        await deferLater(reactor, 0.2, lambda: None)
        state_dir = os.path.abspath(self.mktemp())
        fatal: list[tuple[int, str]] = []
        agent = self.start_agent(backend, state_dir=state_dir, token=False, fatal=fatal, ENROLLMENT_TOKEN=token)
        await backend.wait_for(lambda: bool(fatal), 20)
        await self.stop_agent(agent)
        env = agent_env(backend, state_dir, ENROLLMENT_TOKEN=token)
        findings = await self.run_doctor(make_context(os.path.join(state_dir, "none.env"), env))
        f = one(self, findings, "credential", FAIL)
        self.assertIn("invalid, expired or used", f.detail)
        self.assertIn("mint an enrollment token", f.fix)
        self.assertNotIn(token, f.line())
        # A token never tried: not spent, said to be unchecked.
        fresh = backend.mint_token("fresh")["token"]
        findings = await self.run_doctor(make_context(os.path.join(state_dir, "none.env"),
                                                      agent_env(backend, state_dir, ENROLLMENT_TOKEN=fresh)))
        self.assertIn("not tried here", one(self, findings, "credential", WARN).detail)

    async def test_next_to_a_running_agent(self) -> None:
        """
        With the agent connected: credential ok from its /readyz, no second stream, no token spent,
        the state file untouched, the agent still connected with its one stream.
        """
        backend = await self.start_backend()
        state_dir = os.path.abspath(self.mktemp())
        agent = self.start_agent(backend, state_dir=state_dir)
        node_id = await self.wait_connected(backend, agent)
        ops = OpsService(reactor, agent, 0)
        ops.startService()
        self.addCleanup(ops.stopService)
        port = ops.listening_port
        with open(agent.config.state_path, "rb") as f:
            before = f.read()
        env = agent_env(backend, state_dir, OPS_PORT=str(port))
        ctx = make_context(os.path.join(state_dir, "none.env"), env)
        findings = await diagnose(reactor, ctx)
        f = one(self, findings, "credential", OK)
        self.assertEqual(f.detail, "the running agent is connected with it")
        self.assertEqual(backend.connection_count(node_id), 1)
        self.assertTrue(agent.session.connected)
        with open(agent.config.state_path, "rb") as f2:
            self.assertEqual(f2.read(), before)
        # Without the agent's view, the credential is asked of whoami (read-only, no stream).
        ctx2 = make_context(os.path.join(state_dir, "none.env"), agent_env(backend, state_dir))
        findings = await self.run_doctor(ctx2)
        self.assertIn(node_id, one(self, findings, "credential", OK).detail)
        self.assertEqual(backend.connection_count(node_id), 1)

    async def test_deleted_node(self) -> None:
        """whoami refuses the stored credential: fail, with join or a new token as the fix."""
        backend = await self.start_backend()
        state_dir = os.path.abspath(self.mktemp())
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "state.json"), "w") as f:
            json.dump({"credential": "00000000-0000-0000-0000-000000000000.nope", "node_id": "n"}, f)
        findings = await self.run_doctor(make_context(os.path.join(state_dir, "none.env"),
                                                      agent_env(backend, state_dir)))
        f = one(self, findings, "credential", FAIL)
        self.assertIn("deleted", f.detail)
        self.assertIn("llmport-agent join", f.fix)


class CommandLineTests(SynchronousTestCase):
    def test_json_and_exit_status_from_a_real_process(self) -> None:
        """`llmport-agent doctor --json` as a process: valid JSON, exit 2 with a backend that is down."""
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = dict(os.environ, PYTHONPATH=ROOT, LLM_PORT_NODE_AGENT_BACKEND_URL="http://127.0.0.1:9",
                   LLM_PORT_NODE_AGENT_STATE_PATH=os.path.join(d, "state.json"),
                   LLM_PORT_NODE_AGENT_MODEL_STORE=os.path.join(d, "models"),
                   LLM_PORT_NODE_AGENT_OPS_PORT="0", DOCKER_HOST="unix://" + os.path.join(d, "no.sock"))
        done = subprocess.run([sys.executable, "-m", "llmport_agent.cli", "doctor", "--json",
                               "--env-file", os.path.join(d, "none.env")],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
        self.assertEqual(done.returncode, 2, done.stderr[-2000:])
        report = json.loads(done.stdout)
        self.assertEqual(report["status"], "fail")
        self.assertEqual(report["exit"], 2)
        names = [c["check"] for c in report["checks"]]
        for name in ("configuration", "backend dns", "backend tcp", "credential", "docker engine",
                     "nvidia toolkit", "nvml", "model store", "state directory", "env file",
                     "systemd unit", "journald", "loki", "ray ports", "rdma"):
            self.assertIn(name, names)
        for c in report["checks"]:
            self.assertIn(c["status"], (OK, WARN, FAIL))
            if c["status"] != OK:
                self.assertTrue(c["fix"], c)

    def test_text_lines_in_process(self) -> None:
        out = io.StringIO()
        from llmport_agent.doctor import run

        findings = [ok("a", "fine"), warn("b", "meh", "do x")]
        self.assertEqual(run.report(findings, False, out), 1)
        self.assertEqual(out.getvalue().splitlines(), ["ok    a                   fine",
                                                       "warn  b                   meh -> do x",
                                                       "1 ok, 1 warn, 0 fail"])
        self.assertTrue(callable(main))


class LokiTests(TestCase):
    async def loki(self) -> tuple[Any, str]:
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        fake = FakeLoki()
        port = reactor.listenTCP(0, Site(fake), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return fake, f"http://127.0.0.1:{port.getHost().port}"

    async def run_loki(self, ctx: C.Context) -> list[Finding]:
        return await diagnose(reactor, ctx, [("loki", C.check_loki)])

    async def test_reachable_and_accepting(self) -> None:
        fake, url = await self.loki()
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_LOKI_URL": url, "LLM_PORT_NODE_AGENT_LOKI_TENANT": "t1"})
        ctx.readiness = {}
        f = one(self, await self.run_loki(ctx), "loki", OK)
        self.assertIn("accepts pushes", f.detail)
        self.assertIn("the whole host journal", f.detail)
        self.assertEqual(fake.lines(), [])  # an empty push: nothing stored

    async def test_credentials_refused(self) -> None:
        fake, url = await self.loki()
        fake.fail_next(1, 401)
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_LOKI_URL": url, "LLM_PORT_NODE_AGENT_LOKI_USERNAME": "u",
                             "LLM_PORT_NODE_AGENT_LOKI_PASSWORD": "s3cret-pass"})
        ctx.readiness = {}
        f = one(self, await self.run_loki(ctx), "loki", FAIL)
        self.assertIn("refused the credentials (HTTP 401)", f.detail)
        self.assertIn("LOKI_USERNAME", f.fix)
        self.assertNotIn("s3cret-pass", f.line())

    async def test_unreachable(self) -> None:
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_LOKI_URL": "http://127.0.0.1:9"})
        ctx.readiness = {}
        f = one(self, await self.run_loki(ctx), "loki", FAIL)
        self.assertIn("did not answer", f.detail)
        self.assertIn("LOKI_URL", f.fix)


class LogSinkTests(TestCase):
    """LOKI_URL unset: doctor checks the sink the backend names, as the agent ships to it (issue 26)."""

    CREDENTIAL = "0b7f3c52-1d2e-4f60-9a8b-7c6d5e4f3a21." + "C" * 43

    async def backend(self, answer: Any) -> tuple[str, list[Any]]:
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        asked: list[Any] = []

        class Sink(Resource):
            isLeaf = True

            def render_GET(self, request: Any) -> bytes:  # noqa: N802
                asked.append(request.getHeader(b"authorization"))
                if answer == 404:
                    request.setResponseCode(404)
                    return b'{"detail": "Not Found"}'
                return json.dumps({"loki_url": answer}).encode()

        root = Resource()
        api = Resource()
        files = Resource()
        root.putChild(b"api", api)
        api.putChild(b"node-files", files)
        files.putChild(b"log-sink", Sink())
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}", asked

    def ctx(self, backend: str, **env: str) -> C.Context:
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_BACKEND_URL": backend,
                             **{f"LLM_PORT_NODE_AGENT_{k}": v for k, v in env.items()}})
        assert ctx.config is not None
        os.makedirs(os.path.dirname(ctx.config.state_path), exist_ok=True)
        with open(ctx.config.state_path, "w") as f:
            json.dump({"credential": self.CREDENTIAL}, f)
        ctx.readiness = {}
        return ctx

    async def run_loki(self, ctx: C.Context) -> Finding:
        findings = await diagnose(reactor, ctx, [("loki", C.check_loki)])
        self.assertEqual(len(findings), 1, [f.line() for f in findings])
        return findings[0]

    async def test_a_backend_that_did_not_issue_the_credential_is_not_asked(self) -> None:
        """BACKEND_URL from this shell, not the issuer: the sink question (with the credential) is not sent."""
        url, asked = await self.backend(404)
        ctx = self.ctx(url)
        assert ctx.config is not None
        with open(ctx.config.state_path, "w") as f:
            json.dump({"credential": self.CREDENTIAL, "backend_url": "https://issuer.example:8443"}, f)
        f2 = await self.run_loki(ctx)
        self.assertEqual(f2.status, WARN, f2.line())
        self.assertIn("issuer.example:8443", f2.detail)
        self.assertEqual(asked, [])
        self.assertNotIn(self.CREDENTIAL, f2.line())

    async def test_the_backends_sink_is_checked_not_called_off(self) -> None:
        """Before: "ok loki LOKI_URL unset: log shipping off" while the agent shipped to the backend's sink."""
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        fake = FakeLoki()
        lport = reactor.listenTCP(0, Site(fake), interface="127.0.0.1")
        self.addCleanup(lport.stopListening)
        sink = f"http://sinkuser:sink-pw-s3cret@127.0.0.1:{lport.getHost().port}"
        url, asked = await self.backend(sink)
        f = await self.run_loki(self.ctx(url, LOKI_BEARER_TOKEN="operator-bearer-s3cret"))
        self.assertEqual(f.status, OK, f.line())
        self.assertIn("backend's log sink", f.detail)
        self.assertIn(f"sinkuser:***@127.0.0.1:{lport.getHost().port}", f.detail)
        self.assertNotIn("log shipping off", f.detail)
        self.assertIn("no host journal", f.detail)
        self.assertNotIn("s3cret", f.line())
        self.assertEqual(asked, [f"Bearer {self.CREDENTIAL}".encode()])
        # Pushed as the agent pushes there: the sink's own user info, not the operator's token.
        self.assertEqual(len(fake.pushes), 1)
        self.assertTrue(fake.pushes[0].headers.get("authorization", "").startswith("Basic "))

    async def test_a_failing_backend_sink_fails(self) -> None:
        url, _ = await self.backend("http://127.0.0.1:9")
        f = await self.run_loki(self.ctx(url))
        self.assertEqual(f.status, FAIL, f.line())
        self.assertIn("LOKI_URL unset: the backend's log sink http://127.0.0.1:9 did not answer", f.detail)

    async def test_no_sink(self) -> None:
        for answer in (None, 404):
            url, _ = await self.backend(answer)
            f = await self.run_loki(self.ctx(url))
            self.assertEqual(f.status, OK, f.line())
            self.assertIn("backend names no log sink", f.detail)
            self.assertIn("log shipping off", f.detail)

    async def test_the_running_agents_failed_pushes_are_a_failure(self) -> None:
        """/readyz says 5 failed pushes to the backend's sink: doctor says so, in the agent's words."""
        url, asked = await self.backend("http://127.0.0.1:9")
        ctx = self.ctx(url)
        ctx.readiness = {"checks": {"loki": {
            "ok": False, "source": "backend", "url": "http://127.0.0.1:3100",
            "detail": "5 failed pushes in a row to the backend's log sink http://127.0.0.1:3100 (LOKI_URL unset): "
                      "HTTP 502"}}}
        f = await self.run_loki(ctx)
        self.assertEqual(f.status, FAIL, f.line())
        self.assertIn("5 failed pushes in a row to the backend's log sink", f.detail)
        ctx.readiness["checks"]["loki"].update(ok=True, detail="pushing to the backend's log sink x")
        f = await self.run_loki(ctx)
        self.assertEqual(f.status, OK, f.line())
        self.assertIn("the running agent ships to the backend's log sink", f.detail)


class HostTests(SynchronousTestCase):
    """NVIDIA toolkit, GPU health and RDMA against a scripted /dev, /etc and /sys (sys_root)."""

    def root(self, *files: str) -> str:
        root = os.path.abspath(self.mktemp())
        for name in files:
            path = os.path.join(root, name.lstrip("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("x")
        return root

    def test_nvidia_gpu_without_toolkit(self) -> None:
        ctx = ctx_for(self, {"DOCKER_HOST": "unix:///nonexistent/d.sock"}, sys_root=self.root("/dev/nvidiactl"))
        f = one(self, C.check_nvidia_runtime(ctx), "nvidia toolkit", FAIL)
        self.assertIn("no CDI spec", f.detail)
        self.assertIn("nvidia-container-toolkit", f.fix)
        self.assertIn("nvidia-ctk", f.fix)
        ctx.sys_root = self.root("/dev/nvidiactl", "/etc/cdi/nvidia.yaml")
        self.assertIn("CDI spec /etc/cdi/nvidia.yaml", one(self, C.check_nvidia_runtime(ctx), "nvidia toolkit", OK).detail)
        ctx.sys_root = self.root("/etc/hosts")
        self.assertIn("not needed", one(self, C.check_nvidia_runtime(ctx), "nvidia toolkit", OK).detail)

    def test_nvml_missing_on_a_gpu_host(self) -> None:
        import pynvml

        def no_library() -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

        self.patch(pynvml, "nvmlInit", no_library)
        ctx = ctx_for(self, sys_root=self.root("/dev/nvidiactl"))
        f = one(self, C.check_nvml(ctx), "nvml", FAIL)
        self.assertIn("NVML does not load", f.detail)
        self.assertIn("install the NVIDIA driver", f.fix)
        ctx.sys_root = self.root("/etc/hosts")
        one(self, C.check_nvml(ctx), "nvml", OK)

    def test_gpu_health_from_the_running_agent(self) -> None:
        ctx = ctx_for(self)
        ctx.readiness = {"checks": {"nvml": {"ok": True, "detail": "8 GPU(s), 7 schedulable; GPU 3 unhealthy: Xid 79",
                                             "health": {"healthy": 7, "unhealthy": 1}}}}
        f = one(self, C.check_gpu_health(ctx), "gpu health", FAIL)
        self.assertIn("Xid 79", f.detail)
        self.assertIn("nvidia-smi -r", f.fix)
        ctx.readiness = {"checks": {"nvml": {"ok": True, "detail": "8 GPU(s), 8 schedulable", "health": {"healthy": 8}}}}
        one(self, C.check_gpu_health(ctx), "gpu health", OK)
        ctx.readiness = None
        self.assertEqual(C.check_gpu_health(ctx), [])

    def test_rdma(self) -> None:
        ctx = ctx_for(self, sys_root=self.root("/sys/class/infiniband/mlx5_0"))
        f = one(self, C.check_rdma(ctx), "rdma", WARN)
        self.assertIn("mlx5_0", f.detail)
        self.assertIn("ib_uverbs", f.fix)
        ctx.sys_root = self.root("/sys/class/infiniband/mlx5_0", "/dev/infiniband/uverbs0")
        one(self, C.check_rdma(ctx), "rdma", OK)


class NvmlTests(SynchronousTestCase):
    def test_driver_count_and_uncorrected_ecc(self) -> None:
        """NVML (the project's faithful fake, returning pynvml's own types): driver, count, ECC."""
        import pynvml

        from tests.test_ops import fake_gpus

        fake = fake_gpus(4)
        # GPU 2: uncorrected volatile ECC errors since boot.
        fake.gpus[2].ecc_counts[(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)] = 3
        for name in ("nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
                     "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetTotalEccErrors"):
            self.patch(pynvml, name, getattr(fake, name))
        found = C.check_nvml(ctx_for(self))
        nvml = one(self, found, "nvml", OK)
        self.assertIn("4 GPU(s)", nvml.detail)
        self.assertRegex(nvml.detail, r"^driver \S+, 4 GPU\(s\)$")
        health = one(self, found, "gpu health", WARN)
        self.assertEqual(health.detail, "GPU 2: 3 uncorrected ECC errors since boot")
        self.assertEqual(fake.refcount, 0)  # nvmlShutdown after the check


class SystemdTests(SynchronousTestCase):
    """The unit and journald checks against scripted `systemctl`, `systemd-analyze`, `journalctl`."""

    def tools(self, show: str, exposure: str, journal_rc: int = 0) -> C.Context:
        bindir = os.path.abspath(self.mktemp())
        os.makedirs(bindir)
        scripts = {
            "systemctl": f"#!/bin/sh\ncat <<'E'\n{show}\nE\n",
            "systemd-analyze": f"#!/bin/sh\necho '{exposure}'\n",
            "journalctl": f"#!/bin/sh\nexit {journal_rc}\n",
        }
        for name, text in scripts.items():
            path = os.path.join(bindir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        old = os.environ.get("PATH", "")
        os.environ["PATH"] = bindir + os.pathsep + old
        self.addCleanup(os.environ.__setitem__, "PATH", old)
        root = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(root, "run", "systemd", "system"))
        return ctx_for(self, sys_root=root)

    def test_active_notify_unit(self) -> None:
        ctx = self.tools("LoadState=loaded\nActiveState=active\nSubState=running\nType=notify\n"
                         "NotifyAccess=all\nNRestarts=0",
                         "→ Overall exposure level for llmport-agent.service: 2.8 OK :-)")
        found = C.check_systemd(ctx)
        self.assertIn("active/running, Type=notify", one(self, found, "systemd unit", OK).detail)
        self.assertEqual(one(self, found, "unit exposure", OK).detail, "2.8 OK :-)")
        one(self, C.check_journald(ctx), "journald", OK)

    def test_failed_unit_and_an_exposed_one(self) -> None:
        ctx = self.tools("LoadState=loaded\nActiveState=failed\nSubState=failed\nType=notify",
                         "→ Overall exposure level for llmport-agent.service: 9.1 UNSAFE :-(", journal_rc=1)
        found = C.check_systemd(ctx)
        f = one(self, found, "systemd unit", FAIL)
        self.assertIn("failed/failed", f.detail)
        self.assertIn("journalctl -u llmport-agent.service", f.fix)
        self.assertIn("2.8", one(self, found, "unit exposure", WARN).fix)
        self.assertIn("systemd-journal", one(self, C.check_journald(ctx), "journald", WARN).fix)

    def test_unit_not_installed(self) -> None:
        ctx = self.tools("LoadState=not-found\nActiveState=inactive", "")
        self.assertIn("llmport-agent start", one(self, C.check_systemd(ctx), "systemd unit", WARN).fix)


class SilentBackendTests(SynchronousTestCase):
    def test_a_backend_that_accepts_and_never_answers(self) -> None:
        """TCP accepted, TLS never answered: DNS and TCP lines kept, TLS fails as timed out."""
        server = socket.socket()
        self.addCleanup(server.close)
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        ctx = ctx_for(self, {"LLM_PORT_NODE_AGENT_BACKEND_URL": f"https://127.0.0.1:{port}"})
        ctx.timeout = 0.3
        found = C.check_backend(ctx)
        self.assertEqual([(f.check, f.status) for f in found],
                         [("backend dns", OK), ("backend tcp", OK), ("backend tls", FAIL)])
        self.assertIn("timed out", found[2].detail)


class AprilBackendTests(AgentTestCase):
    async def test_credential_by_stream_upgrade(self) -> None:
        """An April backend has no whoami: a stream upgrade read to its status line, then closed."""
        from llmport_agent.devbackend._state import GENERATION_APRIL

        backend = await self.start_backend(generation=GENERATION_APRIL)
        self.allow_anomalies(".", "the doctor's upgrade closes at once")
        reply = backend.enroll_node("doctor-node")
        state_dir = os.path.abspath(self.mktemp())
        os.makedirs(state_dir)
        state = os.path.join(state_dir, "state.json")
        with open(state, "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        ctx = make_context(os.path.join(state_dir, "none.env"), agent_env(backend, state_dir, AGENT_ID="doctor-node"))
        findings = await diagnose(reactor, ctx, [("credential", C.check_credential)])
        self.assertEqual(one(self, findings, "credential", OK).detail, "the backend accepts it (stream upgrade)")
        with open(state, "w") as f:
            json.dump({"credential": reply["credential"][:-4] + "xxxx", "node_id": reply["node_id"]}, f)
        findings = await diagnose(reactor, ctx, [("credential", C.check_credential)])
        self.assertIn("stream: HTTP 403", one(self, findings, "credential", FAIL).detail)
        await deferLater(reactor, 0.1, lambda: None)


class EngineAccessTests(SynchronousTestCase):
    def test_permission_denied_names_the_docker_group(self) -> None:
        """
        docker-py wraps the socket's EACCES (as a non-root user outside the docker group meets
        it; root here cannot be refused): the finding names the docker group.
        """
        try:
            try:
                raise PermissionError(13, "Permission denied")
            except PermissionError as inner:
                raise ConnectionError("('Connection aborted.', PermissionError(13, 'Permission denied'))") from inner
        except ConnectionError as e:
            found = C._engine_failure("unix:///var/run/docker.sock", e)
        self.assertEqual(found.status, FAIL)
        self.assertIn("permission denied", found.detail)
        self.assertIn("docker group", found.fix)
        other = C._engine_failure("unix:///x.sock", ConnectionError("Connection refused"))
        self.assertIn("systemctl start docker", other.fix)

"""
The path from the process start to the first connect (issue 27: start to connected <= the
original agent's): what is imported before the connect, the garbage collector held off
until it (L{llmport_agent.core.startgc.StartGC}), and packages registered
without their C{__init__} (L{llmport_agent.core.lazypackage.defer_package_init}). No timing
asserts: the figures are bench/bench_idle.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.core.lazypackage import defer_package_init
from llmport_agent.core.startgc import OUT_OF_REACH, StartGC
from tests.agentharness import AnomalyGuard, spawn_agent_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Modules that the path to the first connect must not import (each is imported later, when
#: what needs it first runs). A top-level import of one of them anywhere on that path turns
#: StartPathImportsTests red.
NOT_BEFORE_CONNECT = (
    # autobahn.twisted's package __init__ (WAMP, cryptography's backends): the stream is plain
    # WebSocket (llmport_agent/session/__init__.py).
    "autobahn.twisted.wamp",
    "autobahn.wamp.auth",
    "autobahn.twisted.choosereactor",
    # Autobahn's NVX build scripts parse C declarations at import: the compiled modules' own
    # ffi stands in for them (llmport_agent/core/nvxlight.py).
    "pycparser",
    "cffi.cparser",
    # docker-py and requests: at the first engine client (there is no engine here).
    "docker",
    "requests",
    # The installer: only its commands (start, stop, join, config --set) import it.
    "llmport_agent.host.installer",
    # Built at their first command (core/later.py): workloads, Ray with image seeding, model
    # sync; check_system_updates' module at its first run.
    "llmport_agent.workloads.handlers",
    "llmport_agent.ray.handlers",
    "llmport_agent.ray.seeding",
    "llmport_agent.models.syncer",
    "llmport_agent.commands.system_updates",
    # The ops endpoint listens at start; its web site (twisted.web's server side, the
    # metrics) is built at the port's first connection.
    "llmport_agent.ops.site",
    "llmport_agent.ops.metrics",
    "prometheus_client",
    "twisted.web.server",
    # Log shipping: only with LOKI_URL or a sink the backend names (none here).
    "llmport_agent.logs.wiring",
    # The workload spec parser and its policy checks: at the first deploy (or a managed
    # container's endpoint); the health watcher, adoption and the vLLM inventory section read
    # the container labels from workloads/labels.py.
    "llmport_agent.workloads.spec",
    "llmport_agent.workloads.policy",
    # psutil: at the first inventory collection (the enrollment's capabilities need none of it).
    "psutil",
    # IDNA's UTS 46 table: the enrollment POST to a plain host skips it (core/plainurl.py).
    "idna.uts46data",
    # Twisted's inotify and ctypes.util (find_library runs ldconfig and waits for it): the
    # engine socket watch, made before the connect here (no Docker socket), is the agent's own
    # (workloads/inotify.py), on the libc the process has mapped.
    "twisted.internet.inotify",
    "twisted.python._inotify",
    "ctypes.util",
    # collect_diagnostics' reader: built at the first request for diagnostics.
    "llmport_agent.ops.diagnostics",
    # The inventory sections' readers: at the first inventory, which follows the connect.
    "llmport_agent.inventory.network",
    "llmport_agent.inventory.vllm",
    "llmport_agent.inventory.rayruntime",
    # `run` alone (the unit's command line) builds no command-line parser.
    "argparse",
)

#: The agent as `llmport-agent run` starts it, with a log observer that notes the modules
#: imported (and the collector's thresholds) when the session says it connected (that line is
#: logged in the session's connection_opened, before any listener hears of the connect), and
#: writes them out a second later with the thresholds then.
PROBE = textwrap.dedent(
    """
    import gc, json, sys
    from twisted.logger import globalLogPublisher

    out = sys.argv[1]
    seen = []

    def at_connect(event):
        if seen or not str(event.get("log_format", "")).startswith("Connected to the backend stream"):
            return
        seen.append({"modules": sorted(sys.modules), "gc_threshold": gc.get_threshold()})
        from twisted.internet import reactor

        # Well after the connect's turn (the collector is back on in the next one).
        reactor.callLater(1.0, later)

    def later():
        import os
        seen[0]["gc_threshold_after"] = gc.get_threshold()
        with open(out + ".tmp", "w") as f:
            json.dump(seen[0], f)
        os.rename(out + ".tmp", out)

    globalLogPublisher.addObserver(at_connect)
    from llmport_agent.cli import main
    sys.argv = ["llmport-agent", "run"]
    main()
    """
)


class StartPathImportsTests(AnomalyGuard, TestCase):
    """`llmport-agent run`, fresh node (enrollment, then the stream), against the stand-in."""

    timeout = 120

    async def test_heavy_modules_not_imported_before_the_connect(self) -> None:
        backend = await self.start_watched_backend()
        proc, d, _ = spawn_agent_process(self, backend, PROBE, ["{dir}/at-connect.json"],
                                         "unix:///nonexistent/start-path/docker.sock")
        out = os.path.join(d, "at-connect.json")
        try:
            await backend.wait_for(lambda: os.path.exists(out) or proc.poll() is not None, 90)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            await backend.wait_for(lambda: proc.poll() is not None, 30)
        with open(os.path.join(d, "agent.log"), errors="replace") as f:
            output = f.read()
        self.assertTrue(os.path.exists(out), output[-3000:])
        with open(out) as f:
            seen: dict[str, Any] = json.load(f)
        modules = set(seen["modules"])
        # The probe saw the real connect (not a vacuous pass).
        self.assertIn("llmport_agent.session.service", modules)
        self.assertIn("autobahn.twisted.websocket", modules)
        self.assertEqual(sorted(modules & set(NOT_BEFORE_CONNECT)), [])
        # The collector is held off until the connect, as before after it, and the
        # process still stops cleanly.
        import gc

        default = list(gc.get_threshold())  # this process's: StartGC never ran here
        self.assertEqual(seen["gc_threshold"], [OUT_OF_REACH, OUT_OF_REACH, OUT_OF_REACH])
        self.assertEqual(seen["gc_threshold_after"], default)
        self.assertEqual(proc.returncode, 0, output[-3000:])


class FakeGC:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.thresholds = (700, 10, 10)
        self.calls: list[str] = []

    def isenabled(self) -> bool:
        return self.enabled

    def get_threshold(self) -> tuple[int, int, int]:
        return self.thresholds

    def set_threshold(self, *t: int) -> None:
        self.calls.append(f"threshold {' '.join(map(str, t))}")
        self.thresholds = t  # type: ignore[assignment]

    def collect(self) -> int:
        self.calls.append("collect")
        return 0


HOLD = "threshold 1000000000 1000000000 1000000000"
BACK = "threshold 700 10 10"


class StartGCTests(SynchronousTestCase):
    def make(self, enabled: bool = True) -> tuple[StartGC, FakeGC, Clock]:
        gc, clock = FakeGC(enabled), Clock()
        start = StartGC(window=10.0, gc=gc)
        start.begin()
        start.arm(clock)
        return start, gc, clock

    def test_held_until_the_first_connect(self) -> None:
        """
        The collector held from begin (every generation); at the connect (after
        that turn): one collection, then the thresholds back.
        """
        start, gc, clock = self.make()
        self.assertEqual(gc.calls, [HOLD])
        self.assertTrue(start.held)
        start.session_opened()
        self.assertEqual(gc.calls, [HOLD])  # not in the connect's own turn
        clock.advance(0)
        self.assertEqual(gc.calls, [HOLD, "collect", BACK])
        self.assertFalse(start.held)
        # The window's timer went with it; a later connect changes nothing.
        self.assertEqual(clock.getDelayedCalls(), [])
        start.session_closed()
        start.session_opened()
        clock.advance(20)
        self.assertEqual(gc.calls, [HOLD, "collect", BACK])

    def test_window_without_a_connect(self) -> None:
        """A backend that never answers: the collector is back after the window."""
        start, gc, clock = self.make()
        clock.advance(9.9)
        self.assertTrue(start.held)
        clock.advance(0.1)
        self.assertEqual(gc.calls, [HOLD, "collect", BACK])
        self.assertFalse(start.held)

    def test_collector_already_off_is_left_alone(self) -> None:
        start, gc, clock = self.make(enabled=False)
        self.assertFalse(start.held)
        start.session_opened()
        clock.advance(20)
        start.end()
        self.assertEqual(gc.calls, [])


PACKAGE_INIT = """
import sys
sys.modules[__name__].inits = getattr(sys.modules[__name__], "inits", 0) + 1
from {pkg}.light import VALUE
HEAVY = "heavy"
"""


class DeferPackageInitTests(SynchronousTestCase):
    def package(self) -> str:
        """A fresh package on sys.path whose __init__ counts its runs."""
        base = os.path.abspath(self.mktemp())
        name = "deferinit_" + os.path.basename(base).replace("-", "_").replace(".", "_")
        pkg = os.path.join(base, name)
        os.makedirs(pkg)
        with open(os.path.join(pkg, "__init__.py"), "w") as f:
            f.write(PACKAGE_INIT.format(pkg=name))
        with open(os.path.join(pkg, "light.py"), "w") as f:
            f.write("VALUE = 42\n")
        sys.path.insert(0, base)

        def cleanup() -> None:
            sys.path.remove(base)
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]

        self.addCleanup(cleanup)
        return name

    def test_submodules_without_init_then_init_once(self) -> None:
        import importlib

        name = self.package()
        self.assertTrue(defer_package_init(name))
        light = importlib.import_module(name + ".light")
        self.assertEqual(light.VALUE, 42)
        pkg = sys.modules[name]
        self.assertNotIn("inits", pkg.__dict__)  # the submodule came without __init__
        # The first name only __init__ defines runs it, once.
        self.assertEqual(pkg.HEAVY, "heavy")
        self.assertEqual(pkg.inits, 1)
        self.assertEqual(importlib.import_module(name).VALUE, 42)
        self.assertEqual(pkg.inits, 1)
        with self.assertRaises(AttributeError):
            pkg.missing  # noqa: B018
        self.assertEqual(pkg.inits, 1)

    def test_from_import_runs_init(self) -> None:
        name = self.package()
        defer_package_init(name)
        namespace: dict[str, Any] = {}
        exec(f"from {name} import HEAVY", namespace)
        self.assertEqual(namespace["HEAVY"], "heavy")
        self.assertEqual(sys.modules[name].inits, 1)

    def test_imported_or_missing_packages_are_left_alone(self) -> None:
        self.assertFalse(defer_package_init("json"))  # already imported
        self.assertFalse(defer_package_init("no_such_package_here_xyz"))
        self.assertFalse(defer_package_init("llmport_agent.cli"))  # a module, not a package

    def test_autobahn_deferred_in_a_fresh_interpreter(self) -> None:
        """
        In a fresh interpreter (the agent's order: the session package first), the WebSocket
        client imports without autobahn.twisted's __init__, and a read of one of that
        package's own names then runs it: an Autobahn whose submodules needed their package's
        names at import would turn this red.
        """
        import subprocess

        code = (
            "import sys, llmport_agent.session.protocol, autobahn.twisted.websocket as ws\n"
            "assert 'autobahn.twisted.wamp' not in sys.modules, 'init ran at import'\n"
            "import autobahn.twisted as t\n"
            "assert t.WebSocketClientProtocol is ws.WebSocketClientProtocol\n"
            "print(t.__ident__ if hasattr(t, '__ident__') else 'no-ident', 'autobahn.twisted.wamp' in sys.modules)\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertTrue(out.stdout.strip().endswith("True"), out.stdout)  # __init__ ran at the read

    def test_autobahn_names_still_there(self) -> None:
        """Whatever imported first in this process, autobahn.twisted's own names resolve."""
        import autobahn.twisted
        from autobahn.twisted.websocket import WebSocketClientProtocol

        self.assertIs(autobahn.twisted.WebSocketClientProtocol, WebSocketClientProtocol)
        self.assertTrue(callable(autobahn.twisted.install_reactor))


class PlainURLTests(SynchronousTestCase):
    """L{plain_url}: treq's wire form of a URL, without IDNA's table for a plain host."""

    URLS = (
        "http://127.0.0.1:8000/api/admin/nodes/enroll",
        "https://llm-port.example/api/x%20y/a b?q=ä&r=1#frag",
        "http://host-1.cluster.local.:9/x?y",
        "http://Upper.Example/x",  # mapped to lower case by IDNA: hyperlink's own path
        "http://xn--mgba3a4fra.com/",  # punycode: hyperlink's own path
        "https://ايران.com/foo⇧bar/",
        "http://-bad.example/",
        "http://bad-.example/",
        "http://ab--cd.example/",
        "http://" + "a" * 63 + ".example/",
        "http://" + "a" * 64 + ".example/",
        "http://" + "ab." * 90 + "example/",
        "http://a_b.example/",
        "http://[::1]:8000/x",
    )

    def test_same_wire_form_as_treq_makes(self) -> None:
        from hyperlink import EncodedURL

        from llmport_agent.core.plainurl import plain_url

        def wire(make: Any, url: str) -> str:
            try:
                return str(make(url).to_uri().to_text())
            except Exception as e:  # noqa: BLE001 - the same refusal either way
                return type(e).__name__

        for url in self.URLS:
            self.assertEqual(wire(plain_url, url), wire(EncodedURL.from_text, url), url)

    def test_plain_host_skips_the_uts46_table(self) -> None:
        """In a fresh interpreter: a plain host's wire form leaves the table unloaded, another loads it."""
        script = textwrap.dedent(
            """
            import sys
            from llmport_agent.core.plainurl import plain_url
            seen = []
            for url in sys.argv[1:]:
                plain_url(url).to_uri().to_text()
                seen.append("idna.uts46data" in sys.modules)
            print(seen)
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", script, "http://10.0.0.5:8000/api/x", "https://llm-port.example/a?b=c",
             "http://Upper.Example/"],
            env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, check=True,
        ).stdout
        self.assertEqual(out.strip(), "[False, False, True]")

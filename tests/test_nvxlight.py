"""
Autobahn's NVX validator and masker without their build scripts (L{llmport_agent.core.nvxlight},
issue 27): the agent's import of the stream parses no C, the WebSocket stack works on the light
modules, they answer exactly as Autobahn's own wrappers on a fixed corpus, they carry every
public name Autobahn's have, and nothing is registered where Autobahn would not use NVX.

Each check that depends on what was imported first runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core import nvxlight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(script: str, *args: str, **env: str) -> Any:
    """C{script} in a fresh interpreter on this tree (extra C{env} set); its stdout, as JSON."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOBAHN_USE_NVX")}
    environ.update(env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=environ,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"the fresh interpreter failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


#: The agent's import of its stream, then a real Autobahn client and server in memory (iosim)
#: exchanging text and binary messages, masked both ways and fragmented, then invalid UTF-8.
END_TO_END = """
    import json, sys
    import llmport_agent.session.protocol
    from llmport_agent.core import nvxlight
    import autobahn.websocket.utf8validator as u8, autobahn.websocket.xormasker as xm
    import txaio.testutil
    from autobahn.twisted.websocket import (WebSocketClientFactory, WebSocketClientProtocol,
                                            WebSocketServerFactory, WebSocketServerProtocol)
    from twisted.internet.task import Clock
    from twisted.test import iosim

    seen = {"pycparser_at_import": "pycparser" in sys.modules,
            "cparser_at_import": "cffi.cparser" in sys.modules,
            "light_validator": u8.Utf8Validator is nvxlight.Utf8Validator,
            "light_masker": xm.create_xor_masker is nvxlight.create_xor_masker}
    txaio.testutil.replace_loop(Clock()).__enter__()

    class Echo(WebSocketServerProtocol):
        def onConnect(self, request):
            self.factory.last = self
        def onMessage(self, payload, isBinary):
            self.sendMessage(payload, isBinary)
        def onClose(self, wasClean, code, reason):
            self.factory.closed.append(self.localCloseCode)

    class Client(WebSocketClientProtocol):
        def onOpen(self):
            self.factory.opened = True
        def onMessage(self, payload, isBinary):
            self.factory.received.append((payload, isBinary))
        def onClose(self, wasClean, code, reason):
            self.factory.closed.append(code)

    def connect():
        # failByDrop off: the side that fails the connection says why in a close frame.
        sf = WebSocketServerFactory()
        sf.protocol = Echo
        sf.setProtocolOptions(maskServerFrames=True, autoFragmentSize=1000, failByDrop=False,
                              openHandshakeTimeout=0, closeHandshakeTimeout=0)
        cf = WebSocketClientFactory("ws://127.0.0.1:9000/stream")
        cf.protocol = Client
        cf.setProtocolOptions(acceptMaskedServerFrames=True, autoFragmentSize=777, failByDrop=False,
                              openHandshakeTimeout=0, closeHandshakeTimeout=0)
        cf.opened, cf.received, cf.closed, sf.closed = False, [], [], []
        server, client = sf.buildProtocol(None), cf.buildProtocol(None)
        pump = iosim.connect(server, iosim.makeFakeServer(server), client, iosim.makeFakeClient(client),
                             greet=False)
        pump.flush()
        return cf, sf, client, server, pump

    text = "h\\u00e9llo \\u20ac\\U0001d11e w\\u00f6rld "
    messages = []
    for size in (0, 1, 127, 128, 65536 + 3):
        cut = (text * (size // 4 + 1)).encode()[:size].decode("utf-8", "ignore")
        messages.append((cut + "a" * (size - len(cut.encode())), False))
        messages.append((bytes((i * 151 + 13) & 255 for i in range(size)), True))
    cf, sf, client, server, pump = connect()
    for payload, binary in messages:
        client.sendMessage(payload if binary else payload.encode(), binary)
        pump.flush()
    seen["opened"] = cf.opened
    seen["echoed"] = cf.received == [(p if b else p.encode(), b) for p, b in messages]
    seen["sizes"] = [len(p) for p, _ in cf.received]
    seen["closed_after_valid"] = cf.closed + sf.closed

    # Each side validates what it receives: the close code it sent, the one its peer got, and
    # how many messages got through.
    bad = []
    for payload in (b"ok\\xff", "\\u20ac".encode()[:2] + b"a", b"\\xed\\xa0\\x80", b"x" * 2000 + b"\\xf4\\x90\\x80\\x80"):
        cf, sf, client, server, pump = connect()
        client.sendMessage(payload, False)
        pump.flush()
        to_server = [server.localCloseCode, client.remoteCloseCode, len(cf.received)]
        cf, sf, client, server, pump = connect()
        server.sendMessage(payload, False)
        pump.flush()
        bad.append([to_server, [client.localCloseCode, server.remoteCloseCode, len(cf.received)]])
    seen["invalid"] = bad
    seen["pycparser_after"] = "pycparser" in sys.modules or "cffi.cparser" in sys.modules
    print(json.dumps(seen))
"""


class StartImportTests(SynchronousTestCase):
    def test_stream_without_c_parser_and_still_working(self) -> None:
        """
        The agent's stream imports without pycparser, on the light classes, and Autobahn's
        client and server exchange masked, fragmented text and binary messages of 0, 1, 127,
        128 and 65539 bytes unchanged; invalid UTF-8 (a bad byte, a truncated sequence, a
        surrogate, past U+10FFFF after 2000 good bytes) fails the connection with 1007.
        """
        seen = run_fresh(END_TO_END)
        self.assertEqual(
            {k: seen[k] for k in ("pycparser_at_import", "cparser_at_import", "light_validator",
                                  "light_masker", "opened", "echoed", "closed_after_valid",
                                  "pycparser_after")},
            {"pycparser_at_import": False, "cparser_at_import": False, "light_validator": True,
             "light_masker": True, "opened": True, "echoed": True, "closed_after_valid": [],
             "pycparser_after": False},
        )
        self.assertEqual(seen["sizes"], [0, 0, 1, 1, 127, 127, 128, 128, 65539, 65539])
        self.assertEqual(seen["invalid"], [[[1007, 1007, 0], [1007, 1007, 0]]] * 4)


#: Autobahn's validator and maskers (or the light ones, with the shim) on a fixed corpus: every
#: answer of validate (whole, chunked, byte by byte, after a failure, after reset) and every
#: masked payload (whole and in uneven pieces, with pointer) for a set of masks and lengths.
CORPUS = """
    import hashlib, inspect, json, sys, types
    if sys.argv[1] == "light":
        import llmport_agent.session
    import autobahn.nvx._utf8validator as u8mod
    import autobahn.nvx._xormasker as xmod

    CASES = [b"", b"hello", "h\\u00e9llo \\u20ac\\U0001d11e w\\u00f6rld".encode(),
             b"\\xe2\\x82", b"\\xf0\\x9d\\x84", b"\\xc3", b"\\x80", b"a\\xbfb",
             b"\\xc0\\xaf", b"\\xc1\\xbf", b"\\xe0\\x80\\xaf", b"\\xe0\\x9f\\xbf", b"\\xf0\\x80\\x80\\xaf",
             b"\\xf0\\x8f\\xbf\\xbf", b"\\xed\\xa0\\x80", b"\\xed\\xbf\\xbf", b"\\xed\\x9f\\xbf",
             b"\\xee\\x80\\x80", b"\\xf4\\x8f\\xbf\\xbf", b"\\xf4\\x90\\x80\\x80", b"\\xf5\\x80\\x80\\x80",
             b"\\xf8\\x88\\x80\\x80\\x80", b"\\xfe", b"\\xff", b"ok\\xffok",
             ("abc\\u00e9\\u20ac\\U0001f600" * 300).encode(),
             ("abc\\u00e9\\u20ac\\U0001f600" * 300).encode()[:3001] + b"\\xc0\\xaf" + b"tail" * 50,
             b"x" * 4095 + b"\\xe2\\x82\\xac", b"x" * 4096 + b"\\xed\\xa0\\x80"]

    def feeds(data):
        yield "whole", [data]
        for size in (1, 3, 7, 64):
            yield f"by {size}", [data[i:i + size] for i in range(0, len(data), size)] or [b""]

    validator = u8mod.Utf8Validator()
    utf8 = {}
    for n, data in enumerate(CASES):
        for how, chunks in feeds(data):
            validator.reset()
            utf8[f"{n} {how}"] = [list(validator.validate(c)) for c in chunks]
            # Fed on after the message ended (or failed), then reset and fed the same again.
            utf8[f"{n} {how} then more"] = [list(validator.validate(b"more\\xc3\\xa9"))]
            validator.reset()
            utf8[f"{n} {how} after reset"] = [list(validator.validate(c)) for c in chunks]
    fresh = u8mod.Utf8Validator()
    utf8["fresh"] = [list(fresh.validate(b"\\xce\\xba\\xe1\\xbd\\xb9"))]

    def show(data):
        return data.hex() if len(data) <= 129 else hashlib.sha256(data).hexdigest()

    MASKS = [b"\\x00\\x00\\x00\\x00", b"\\x01\\x02\\x03\\x04", b"\\xff\\xff\\xff\\xff", b"\\x37\\xfa\\x21\\x3d"]
    MAKERS = {
        "factory": lambda m, n: xmod.create_xor_masker(m, n),
        "factory no length": lambda m, n: xmod.create_xor_masker(m),
        "simple": lambda m, n: xmod.XorMaskerSimple(m),
        "shifted1": lambda m, n: xmod.XorMaskerShifted1(m),
        "nvx scalar": lambda m, n: xmod.XorMaskerNvx(m, use_simd=False),
        "nvx": lambda m, n: xmod.XorMaskerNvx(m),
    }
    xor = {}
    for mask in MASKS:
        for n in (0, 1, 3, 4, 5, 127, 128, 129, 4096):
            payload = bytes((i * 31 + 7) & 255 for i in range(n))
            for name, make in MAKERS.items():
                masker = make(mask, n)
                whole = masker.process(payload)
                after_whole = masker.pointer()
                masker.reset()
                pieces, i, step = [], 0, 1
                while i < n:
                    pieces.append(masker.process(payload[i:i + step]))
                    i, step = i + step, step % 6 + 1
                xor[f"{mask.hex()} {n} {name}"] = [type(masker).__name__, show(whole), after_whole,
                                                   show(b"".join(pieces)), masker.pointer()]

    # What the build scripts import or leave behind (fd: the C source's file, closed).
    BUILD_ONLY = {"FFI", "get_compile_args", "ffi", "c_source", "extra_compile_args", "optional", "fd"}

    def shape(obj):
        def params(fn):
            return [[p.name, None if p.default is p.empty else repr(p.default)]
                    for p in inspect.signature(fn).parameters.values()]
        if isinstance(obj, type):
            return {"methods": {k: params(getattr(obj, k)) for k in dir(obj)
                                if callable(getattr(obj, k)) and (not k.startswith("_") or k == "__init__")}}
        if callable(obj):
            return {"params": params(obj)}
        return {"value": repr(obj)}

    def public(mod):
        return {k: shape(v) for k, v in vars(mod).items()
                if not k.startswith("_") and k not in BUILD_ONLY and not isinstance(v, types.ModuleType)}

    print(json.dumps({"modules": [u8mod.__file__, xmod.__file__], "utf8": utf8, "xor": xor,
                      "api": {"utf8": public(u8mod), "xor": public(xmod)},
                      "pycparser": "pycparser" in sys.modules}))
"""


class EquivalenceTests(SynchronousTestCase):
    """The light modules against Autobahn's own wrappers, each in a fresh interpreter."""

    def setUp(self) -> None:
        self.real = run_fresh(CORPUS, "real")
        self.light = run_fresh(CORPUS, "light")

    def test_which_modules_ran(self) -> None:
        """Not a vacuous comparison: Autobahn's wrappers (with the C parser) against the light ones."""
        self.assertTrue(all(f.endswith(("_utf8validator.py", "_xormasker.py")) for f in self.real["modules"]))
        self.assertTrue(self.real["pycparser"])
        self.assertEqual(self.light["modules"], [nvxlight.__file__] * 2)
        self.assertFalse(self.light["pycparser"])

    def test_same_validation(self) -> None:
        self.assertEqual(len(self.real["utf8"]), 29 * 5 * 3 + 1)
        for key, answers in self.real["utf8"].items():
            self.assertEqual(self.light["utf8"][key], answers, key)

    def test_same_masking(self) -> None:
        self.assertEqual(self.light["xor"], self.real["xor"])
        # And the masking itself, on the short payloads (a corpus both got wrong would pass above).
        for key, (_, whole, pointer, pieces, after) in self.light["xor"].items():
            mask_hex, n = key.split()[:2]
            mask, length = bytes.fromhex(mask_hex), int(n)
            if length <= 129:
                expected = bytes(((i * 31 + 7) & 255) ^ mask[i % 4] for i in range(length)).hex()
                self.assertEqual((whole, pieces, pointer, after), (expected, expected, length, length), key)

    def test_every_public_name_of_autobahn(self) -> None:
        """
        Every public name of Autobahn's two modules (what they import for the build aside),
        with the same parameters and public methods: an Autobahn that adds or changes one
        turns this red.
        """
        real, light = self.real["api"], self.light["api"]
        self.assertEqual(sorted(real["utf8"]), ["Utf8Validator"])
        for module in ("utf8", "xor"):
            for name, shape in real[module].items():
                self.assertEqual(light[module].get(name), shape, f"{module}: {name}")


FALLBACK = """
    import json, sys
    if sys.argv[1] == "compiled module missing":
        sys.modules["_nvx_utf8validator"] = None
    from llmport_agent.core.nvxlight import install_light_nvx
    first = install_light_nvx()
    second = install_light_nvx()
    import autobahn.websocket as ws
    import autobahn.websocket.utf8validator as u8, autobahn.websocket.xormasker as xm
    print(json.dumps({"first": first, "second": second, "uses_nvx": ws.USES_NVX,
                      "validator": u8.Utf8Validator.__module__,
                      "masker": xm.create_xor_masker.__module__,
                      "pycparser": "pycparser" in sys.modules}))
"""


class FallbackTests(SynchronousTestCase):
    """Nothing registered where Autobahn would not use NVX, or has chosen already."""

    def test_turned_off_as_autobahn_reads_it(self) -> None:
        for value in ("0", "no", "false", " FALSE ", "No"):
            self.assertTrue(nvxlight.nvx_turned_off({"AUTOBAHN_USE_NVX": value}), value)
        for value in ("", "1", "yes", "true", "off", "maybe"):
            self.assertFalse(nvxlight.nvx_turned_off({"AUTOBAHN_USE_NVX": value}), value)
        self.assertFalse(nvxlight.nvx_turned_off({}))

    def test_nvx_turned_off(self) -> None:
        """AUTOBAHN_USE_NVX=0: not installed, Autobahn's pure-Python classes."""
        seen = run_fresh(FALLBACK, "off", AUTOBAHN_USE_NVX=" False")
        self.assertEqual(seen, {"first": False, "second": False, "uses_nvx": False,
                                "validator": "autobahn.websocket.utf8validator",
                                "masker": "autobahn.websocket.xormasker", "pycparser": False})

    def test_compiled_module_missing(self) -> None:
        seen = run_fresh(FALLBACK, "compiled module missing")
        self.assertEqual(seen, {"first": False, "second": False, "uses_nvx": False,
                                "validator": "autobahn.websocket.utf8validator",
                                "masker": "autobahn.websocket.xormasker", "pycparser": False})

    def test_installed_once(self) -> None:
        """Installed at the first call (also with AUTOBAHN_USE_NVX=1), not at the second."""
        light = {"first": True, "second": False, "uses_nvx": True,
                 "validator": "llmport_agent.core.nvxlight", "masker": "llmport_agent.core.nvxlight",
                 "pycparser": False}
        self.assertEqual(run_fresh(FALLBACK, "default"), light)
        self.assertEqual(run_fresh(FALLBACK, "on", AUTOBAHN_USE_NVX="1"), light)

    def test_after_autobahn_chose(self) -> None:
        """In this process autobahn.websocket's validator is imported: nothing is done."""
        import autobahn.websocket.utf8validator  # noqa: F401

        self.assertFalse(nvxlight.install_light_nvx())

    def test_package_import_still_works(self) -> None:
        """autobahn.nvx (whose __init__ imports from the first module) imports over the light modules."""
        seen = run_fresh("""
            import json, sys
            import llmport_agent.session
            import autobahn.nvx
            from autobahn.nvx import Utf8Validator
            print(json.dumps([Utf8Validator.__module__, autobahn.nvx._utf8validator.__name__,
                              autobahn.nvx._xormasker.__name__, "pycparser" in sys.modules]))
        """)
        self.assertEqual(seen, ["llmport_agent.core.nvxlight", nvxlight.UTF8_MODULE, nvxlight.XOR_MODULE, False])

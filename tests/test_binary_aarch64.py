"""
The standalone executables by platform name, as llm-port's installer serves them.

Linux aarch64 (built on x86_64 by `packaging/build-binary linux-aarch64`): an aarch64 ELF named
llmport-agent-linux-aarch64, its sha256 beside it, and its `demo` (the stand-in backend and an
agent, end to end on loopback) passing under qemu-user. This machine's platform (`packaging/
build-binary`, which .ci/run runs): dist/llmport-agent and the same file as
llmport-agent-linux-<arch> with its sha256.

Building the aarch64 one takes minutes (an arm64 Debian tree and PyInstaller under emulation, about 7 the
first time and 4 with the tree cached), so the test suite does not build it: it runs when
LLMPORT_AGENT_AARCH64_BINARY names one, and skips with a one-line reason otherwise (or when
qemu-user and its binfmt_misc entry are absent on an x86_64 host). The executable needs an
aarch64 C library under emulation: LLMPORT_AGENT_AARCH64_SYSROOT, default the build's tree
(build/arm64-root).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess

from twisted.trial.unittest import SkipTest, TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "llmport-agent-linux-aarch64"
EM_AARCH64 = 183


def _binary() -> str:
    path = os.environ.get("LLMPORT_AGENT_AARCH64_BINARY", "")
    if not path:
        raise SkipTest("no aarch64 executable: set LLMPORT_AGENT_AARCH64_BINARY "
                       "(packaging/build-binary linux-aarch64 builds one)")
    path = os.path.join(ROOT, path)  # a relative path is the checkout's (trial runs elsewhere)
    if not os.path.isfile(path):
        raise AssertionError(f"LLMPORT_AGENT_AARCH64_BINARY={path} is not a file")
    return os.path.abspath(path)


def _runner_env() -> dict[str, str]:
    """The environment that runs an aarch64 executable here (qemu-user on other machines)."""
    env = dict(os.environ)
    if platform.machine() in ("aarch64", "arm64"):
        return env
    entry = "/proc/sys/fs/binfmt_misc/qemu-aarch64"
    try:
        with open(entry) as f:
            text = f.read()
    except OSError:
        raise SkipTest("qemu-user for aarch64 is not registered in binfmt_misc "
                       "(apt-get install qemu-user-static binfmt-support)") from None
    if not text.startswith("enabled"):
        raise SkipTest("the binfmt_misc entry qemu-aarch64 is disabled "
                       "(update-binfmts --enable qemu-aarch64)")
    sysroot = os.environ.get("LLMPORT_AGENT_AARCH64_SYSROOT",
                             os.path.join(ROOT, "build", "arm64-root"))
    if not os.path.exists(os.path.join(sysroot, "lib", "ld-linux-aarch64.so.1")):
        raise SkipTest(f"no aarch64 C library at {sysroot} (LLMPORT_AGENT_AARCH64_SYSROOT: "
                       "an arm64 Debian tree, e.g. the one packaging/build-binary-aarch64 leaves)")
    env["QEMU_LD_PREFIX"] = sysroot
    return env


class AArch64ExecutableTests(TestCase):
    timeout = 600

    def test_named_and_checksummed_as_the_installer_serves_it(self) -> None:
        """An aarch64 ELF named llmport-agent-linux-aarch64 with a matching .sha256 beside it."""
        path = _binary()
        self.assertEqual(os.path.basename(path), NAME)
        with open(path, "rb") as f:
            header = f.read(20)
            f.seek(0)
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self.assertEqual(header[:4], b"\x7fELF")
        self.assertEqual(header[4], 2, "not a 64-bit ELF")
        self.assertEqual(int.from_bytes(header[18:20], "little"), EM_AARCH64, "not aarch64")
        self.assertTrue(os.access(path, os.X_OK))
        with open(path + ".sha256") as f:
            line = f.read()
        self.assertEqual(line, f"{digest}  {NAME}\n")  # `sha256sum -c` format, from dist/

    def test_demo_under_qemu_user(self) -> None:
        """`demo` of the aarch64 executable passes: enrol, commands, clean stop."""
        path = _binary()
        env = _runner_env()
        env.pop("PYTHONPATH", None)  # nothing of this checkout's Python may leak in
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
        tmp = self.mktemp()
        os.makedirs(tmp)
        env["TMPDIR"] = tmp
        version = subprocess.run([path, "--version"], env=env, capture_output=True, text=True,
                                 timeout=120)
        self.assertEqual(version.returncode, 0, version.stderr[-2000:])
        self.assertIn("llmport-agent", version.stdout)
        demo = subprocess.run([path, "demo"], env=env, capture_output=True, text=True,
                              timeout=480, cwd=tmp)
        out = demo.stdout + demo.stderr
        self.assertEqual(demo.returncode, 0, out[-3000:])
        self.assertIn("demo finished", out)
        self.assertIn(": OK", out)
        self.assertIn("stopped cleanly", out)
        # The onefile executable unpacks under TMPDIR and removes it again.
        self.assertEqual([n for n in os.listdir(tmp) if n.startswith("_MEI")], [])
        shutil.rmtree(tmp, ignore_errors=True)


class NativeNamingTests(TestCase):
    """`packaging/build-binary` on this machine: dist/llmport-agent, and the same file by its platform name."""

    def test_platform_name_and_sha256_beside_it(self) -> None:
        path = os.environ.get("LLMPORT_AGENT_BINARY", "")
        if not path or not os.path.exists(path):
            reason = "LLMPORT_AGENT_BINARY is not set (run .ci/run, or packaging/build-binary)"
            if os.environ.get("LLMPORT_REQUIRE_INSTALL") == "1":
                raise AssertionError(reason)
            raise SkipTest(reason)
        arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
        name = f"llmport-agent-linux-{arch}"
        named = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        with open(named, "rb") as f:
            self.assertEqual(hashlib.file_digest(f, "sha256").hexdigest(), digest)
        with open(named + ".sha256") as f:
            self.assertEqual(f.read(), f"{digest}  {name}\n")

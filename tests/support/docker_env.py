"""
A real Docker engine (and registry) for the tests, started once per test process.

L{require_docker} returns the shared L{DockerEnv}, starting it on first use:

 - C{dockerd} on a unix socket in a short directory under C{/tmp}, with its own data and
   exec roots, C{--bridge=none --iptables=false --ip-masq=false} (no private-range
   addresses, no firewall changes);
 - a busybox image made with C{docker import} from a root file system holding the static
   C{/bin/busybox} and its applet links (tag L{BUSYBOX});

L{require_registry} adds a real C{docker-registry} on C{127.0.0.1:<free port>} with test
images pushed to it.

Everything is stopped by PID at process exit. Where the engine cannot be had (not root, no
packages), the tests skip with a one-line reason, unless C{LLMPORT_REQUIRE_DOCKER=1} (CI),
which turns that into a failure.

This is test infrastructure: it blocks while starting daemons (once per process) and is
never imported by the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from typing import Any

from twisted.trial.unittest import SkipTest

BUSYBOX = "llmport-test/busybox:1"
REQUIRE_ENV = "LLMPORT_REQUIRE_DOCKER"

_env: DockerEnv | None = None
_env_error: str | None = None
_registry: Registry | None = None
_registry_error: str | None = None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def _stop_child(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM our child, wait (reaping it), SIGKILL if it does not exit."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


def _kill_pid(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM, wait, SIGKILL a process that is not our child (by PID)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _busybox_rootfs_tar() -> bytes:
    """A tar of a root file system: /bin/busybox plus its applet links, /tmp, /www."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    real = os.path.realpath(busybox)
    out = subprocess.run([real, "--list"], capture_output=True, check=True, text=True)
    applets = [a for a in out.stdout.split() if a and a != "busybox"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "www", "etc", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(real, arcname="bin/busybox")
        for applet in applets:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return buf.getvalue()


class DockerEnv:
    """One dockerd for the whole test process."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="lpd", dir="/tmp")
        self.socket = os.path.join(self.root, "d.sock")
        self.host = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.root, "dockerd.log")
        self._client: Any = None

    # -- daemon -------------------------------------------------------------------------

    def start(self) -> None:
        """Start dockerd and wait until it answers (blocking; test setup only)."""
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise RuntimeError("dockerd is not installed")
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept for the daemon's lifetime
        self.proc = subprocess.Popen(
            [
                dockerd,
                "--host",
                self.host,
                "--data-root",
                os.path.join(self.root, "data"),
                "--exec-root",
                os.path.join(self.root, "x"),
                "--pidfile",
                os.path.join(self.root, "d.pid"),
                "--bridge=none",
                "--iptables=false",
                "--ip-masq=false",
                "--ip6tables=false",
                "--shutdown-timeout=2",
                "--log-level=warn",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        try:
            _wait_for(self._ping, 60, "dockerd to answer")
        except RuntimeError:
            tail = open(self.log_path, "rb").read()[-2000:].decode("utf-8", "replace")
            self.stop()
            raise RuntimeError(f"dockerd did not start: {tail}") from None

    def _ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited with {self.proc.returncode}")
        try:
            return bool(self.client().ping())
        except Exception:  # noqa: BLE001 - not up yet
            self._client = None
            return False

    def stop(self) -> None:
        """Stop dockerd (SIGTERM, then SIGKILL) and its containerd, by PID."""
        if self.proc is None:
            return
        children: list[int] = []
        pid = self.proc.pid
        with contextlib.suppress(OSError, ValueError):
            children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        _stop_child(self.proc)
        self.proc = None
        for child in children:
            # dockerd's own containerd: ours only if its command line names our directory.
            with contextlib.suppress(OSError):
                if self.root in open(f"/proc/{child}/cmdline").read():
                    _kill_pid(child, 5)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None

    def restart(self) -> None:
        """Stop and start dockerd on the same socket and data (blocking)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- helpers --------------------------------------------------------------------------

    def client(self) -> Any:
        """A blocking docker-py client for test setup and assertions."""
        import docker

        if self._client is None:
            self._client = docker.DockerClient(base_url=self.host, version="auto", timeout=60)
        return self._client

    def ensure_busybox(self) -> None:
        """Import the busybox image unless it exists."""
        import docker

        api = self.client().api
        try:
            api.inspect_image(BUSYBOX)
            return
        except docker.errors.NotFound:
            pass
        repo, tag = BUSYBOX.rsplit(":", 1)
        api.import_image_from_data(_busybox_rootfs_tar(), repository=repo, tag=tag)

    def managed_containers(self, runtime_id: str | None = None) -> list[Any]:
        """Containers carrying the agent's managed label (optionally of one runtime)."""
        label = "io.llmport.managed=llmport-agent"
        filters: dict[str, Any] = {"label": [label]}
        if runtime_id:
            filters["label"].append(f"io.llmport.runtime-id={runtime_id}")
        return list(self.client().containers.list(all=True, filters=filters))

    def remove_all_containers(self) -> None:
        """Force-remove every container on the test engine."""
        client = self.client()
        for c in client.containers.list(all=True):
            with contextlib.suppress(Exception):
                c.remove(force=True)

    def remove_image(self, ref: str) -> None:
        """Remove an image if present (force)."""
        import docker

        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            self.client().images.remove(ref, force=True)

    def shutdown(self) -> None:
        """Everything down and the directory gone (atexit)."""
        if self.running:
            with contextlib.suppress(Exception):
                self.remove_all_containers()
        self.stop()
        self._unmount_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)

    def _unmount_leftovers(self) -> None:
        """dockerd leaves its network namespace mount (exec-root/netns/default) behind."""
        mounts: list[str] = []
        with contextlib.suppress(OSError):
            for line in open("/proc/self/mounts"):
                parts = line.split()
                if len(parts) > 1 and parts[1].startswith(self.root + "/"):
                    mounts.append(parts[1])
        for path in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", path], capture_output=True, check=False)


class Registry:
    """A real docker-registry on 127.0.0.1:<free port>, with test images pushed."""

    def __init__(self, env: DockerEnv) -> None:
        self.env = env
        self.root = os.path.join(env.root, "reg")
        os.makedirs(self.root, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("docker-registry")
        if exe is None:
            raise RuntimeError("docker-registry is not installed")
        config = os.path.join(self.root, "config.yml")
        with open(config, "w") as f:
            f.write(
                "version: 0.1\n"
                "log:\n  level: error\n  accesslog:\n    disabled: true\n"
                f"storage:\n  filesystem:\n    rootdirectory: {self.root}/data\n"
                "  delete:\n    enabled: true\n"
                f"http:\n  addr: {self.address}\n"
            )
        log = open(os.path.join(self.root, "registry.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, "serve", config],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("docker-registry exited")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                return False

        _wait_for(up, 30, "docker-registry to listen")

    def stop(self) -> None:
        if self.proc is not None:
            _stop_child(self.proc, 10)
            self.proc = None

    def ref(self, name: str) -> str:
        """C{127.0.0.1:<port>/<name>}."""
        return f"{self.address}/{name}"

    def push_image(self, local: str, name: str) -> str:
        """Tag C{local} as C{<registry>/<name>}, push it, drop the local tag."""
        api = self.env.client().api
        target = self.ref(name)
        repo, tag = target.rsplit(":", 1)
        api.tag(local, repo, tag)
        for msg in api.push(repo, tag=tag, stream=True, decode=True):
            if msg.get("error"):
                raise RuntimeError(f"push of {target} failed: {msg['error']}")
        api.remove_image(target)
        return target

    def make_layered_image(self, name: str, size: int) -> str:
        """A two-layer image (busybox + C{size} random bytes), pushed; returns its ref."""
        client = self.env.client()
        container = client.containers.create(
            BUSYBOX, ["sh", "-c", f"head -c {size} /dev/urandom > /blob"], network_mode="none"
        )
        try:
            container.start()
            container.wait(timeout=60)
            local = f"llmport-test/{name.replace('/', '-').replace(':', '-')}:build"
            repo, tag = local.rsplit(":", 1)
            container.commit(repository=repo, tag=tag)
        finally:
            container.remove(force=True)
        try:
            return self.push_image(local, name)
        finally:
            self.env.remove_image(local)

    def blob_paths(self, min_size: int) -> list[str]:
        """Paths of blob files in the registry's storage at least C{min_size} bytes long."""
        out = []
        for dirpath, _dirs, files in os.walk(os.path.join(self.root, "data")):
            if "data" in files and "/blobs/" in dirpath:
                path = os.path.join(dirpath, "data")
                if os.path.getsize(path) >= min_size:
                    out.append(path)
        return out


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def _unavailable(reason: str) -> None:
    if _required():
        raise AssertionError(f"{REQUIRE_ENV}=1 but the Docker test engine is unavailable: {reason}")
    raise SkipTest(reason)


def _shutdown() -> None:
    if _registry is not None:
        _registry.stop()
    if _env is not None:
        _env.shutdown()


def require_docker() -> DockerEnv:
    """
    The shared engine (started on first use). Skips (or, with LLMPORT_REQUIRE_DOCKER=1,
    fails) when it cannot be had.
    """
    global _env, _env_error
    if _env is not None:
        if not _env.running:
            _env.start()
        return _env
    if _env_error is not None:
        _unavailable(_env_error)
    if os.geteuid() != 0:
        _env_error = "the Docker test engine needs root (dockerd)"
    elif shutil.which("dockerd") is None:
        _env_error = "needs Debian package docker.io (dockerd is missing): sudo apt-get install docker.io"
    elif shutil.which("busybox") is None:
        _env_error = ("needs Debian package busybox-static (busybox is missing): "
                      "sudo apt-get install busybox-static")
    if _env_error is not None:
        _unavailable(_env_error)
    env = DockerEnv()
    try:
        env.start()
        env.ensure_busybox()
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        env.shutdown()
        _env_error = f"could not start the Docker test engine: {exc}"
        _unavailable(_env_error)
    _env = env
    atexit.register(_shutdown)
    return env


def require_registry() -> Registry:
    """The shared registry (started on first use), with C{llmport/busybox:1} pushed."""
    global _registry, _registry_error
    env = require_docker()
    if _registry is not None:
        return _registry
    if _registry_error is not None:
        _unavailable(_registry_error)
    if shutil.which("docker-registry") is None:
        _registry_error = ("needs Debian package docker-registry (docker-registry is missing): "
                           "sudo apt-get install docker-registry")
        _unavailable(_registry_error)
    registry = Registry(env)
    try:
        registry.start()
        registry.push_image(BUSYBOX, "llmport/busybox:1")
    except Exception as exc:  # noqa: BLE001
        registry.stop()
        _registry_error = f"could not start the test registry: {exc}"
        _unavailable(_registry_error)
    _registry = registry
    return registry

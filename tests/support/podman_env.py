"""
A real Podman engine for the tests: C{podman system service} on a unix socket, answering the
Docker-compatible API, started once per test process (like L{docker_env}).

Settings that make it run on these machines (found for issue 13), all in a private
C{containers.conf} (C{CONTAINERS_CONF}) and flags, nothing in C{/etc}:

 - C{default_ulimits} set to the host's own hard limits: as root, Podman 4.3 raises every
   container's C{RLIMIT_NOFILE}/C{RLIMIT_NPROC} to 1048576/4194304, above what a host (or a
   sandbox) without C{CAP_SYS_RESOURCE} allows: every start then fails with C{error setting
   rlimit type 7 (or 6): operation not permitted}. The process limit must also stay within
   C{kernel.pid_max}, to which Podman lowers its own (and so conmon's) limit;
 - C{--storage-driver vfs} (no overlay mounts), C{--cgroup-manager cgroupfs} (no systemd),
   C{--events-backend file} (no journald), root, run root and tmp dir in a short directory
   under C{/tmp};
 - networking: C{netns="host"} by default, and the CNI plugin directory pointed at an empty
   directory, so a container can never be put on Podman's default bridge (10.88.0.0/16, a
   private range): it would fail instead. The tests use host networking.

Where Podman cannot be had (not root, package missing, the service does not start), the
tests skip with that reason, unless C{LLMPORT_REQUIRE_PODMAN=1} (CI), which turns it into a
failure.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from typing import Any

from twisted.trial.unittest import SkipTest

from .docker_env import BUSYBOX, DockerEnv, _busybox_rootfs_tar, _stop_child

REQUIRE_ENV = "LLMPORT_REQUIRE_PODMAN"

_env: PodmanEnv | None = None
_env_error: str | None = None


def _limits() -> tuple[int, int]:
    """
    The limits the containers may have: the host's hard limits, and for processes also
    C{kernel.pid_max} (Podman lowers its own, and so conmon's, process limit to it).
    """
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read().strip())
    except (OSError, ValueError):
        pid_max = 32768
    cap_nofile = 1048576 if nofile == resource.RLIM_INFINITY else min(nofile, 1048576)
    cap_nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return cap_nofile, cap_nproc


class PodmanEnv(DockerEnv):
    """One C{podman system service} for the whole test process (DockerEnv's helpers, Podman's daemon)."""

    kind = "podman"

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="lpp", dir="/tmp")
        self.socket = os.path.join(self.root, "p.sock")
        self.host = f"unix://{self.socket}"
        self.conf = os.path.join(self.root, "containers.conf")
        self.registries = os.path.join(self.root, "registries.conf")
        self.log_path = os.path.join(self.root, "podman.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None
        os.makedirs(os.path.join(self.root, "no-cni-plugins"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "cni"), exist_ok=True)
        nofile, nproc = _limits()
        with open(self.registries, "w") as f:
            # The test registry serves plain HTTP on loopback (Docker allows that for
            # 127.0.0.0/8 by itself; Podman must be told). "127.0.0.1" covers every port.
            f.write('unqualified-search-registries = ["docker.io"]\n'
                    '[[registry]]\nlocation = "127.0.0.1"\ninsecure = true\n')
        with open(self.conf, "w") as f:
            f.write(
                "[containers]\n"
                f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                'netns = "host"\n'
                "[network]\n"
                'network_backend = "cni"\n'
                f'network_config_dir = "{self.root}/cni"\n'
                f'cni_plugin_dirs = ["{self.root}/no-cni-plugins"]\n'
                "[engine]\n"
                'cgroup_manager = "cgroupfs"\n'
                'events_logger = "file"\n'
                f'events_logfile_path = "{self.root}/events.log"\n'
                f'tmp_dir = "{self.root}/tmp"\n'
                'runtime = "runc"\n'
            )

    def _base(self) -> list[str]:
        podman = shutil.which("podman")
        if podman is None:
            raise RuntimeError("podman is not installed")
        return [
            podman,
            "--root", os.path.join(self.root, "root"),
            "--runroot", os.path.join(self.root, "run"),
            "--tmpdir", os.path.join(self.root, "tmp"),
            "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "file",
        ]

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CONTAINERS_CONF"] = self.conf
        env["CONTAINERS_REGISTRIES_CONF"] = self.registries
        env.pop("DOCKER_HOST", None)
        return env

    # -- service --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the service and wait until it answers (blocking; test setup only)."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept for the service's lifetime
        self.proc = subprocess.Popen(
            [*self._base(), "system", "service", "--time", "0", self.host],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=self._environ(),
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._ping():
                return
            time.sleep(0.1)
        tail = open(self.log_path, "rb").read()[-2000:].decode("utf-8", "replace")
        self.stop()
        raise RuntimeError(f"podman system service did not start: {tail}")

    def _ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except Exception:  # noqa: BLE001 - not up yet
            self._client = None
            return False

    def stop(self) -> None:
        """Stop the service (SIGTERM, then SIGKILL), by PID; conmon processes stay with their containers."""
        if self.proc is None:
            return
        _stop_child(self.proc)
        self.proc = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None

    # -- helpers (client, managed_containers, remove_* come from DockerEnv)

    def ensure_busybox(self) -> None:
        import docker

        api = self.client().api
        try:
            api.inspect_image(BUSYBOX)
            return
        except docker.errors.NotFound:
            pass
        repo, tag = BUSYBOX.rsplit(":", 1)
        # Podman 4.3's import ignores the tag (it names the image ...:latest): tag it after.
        answer = api.import_image_from_data(_busybox_rootfs_tar(), repository=repo, tag=tag)
        image_id = json.loads(answer.strip().splitlines()[-1])["id"] if isinstance(answer, str) else answer
        api.tag(image_id, repo, tag)
        api.inspect_image(BUSYBOX)

    def shutdown(self) -> None:
        """Every container removed (their conmon processes end with them), service down, files gone."""
        if self.running:
            with contextlib.suppress(Exception):
                self.remove_all_containers()
        self.stop()
        with contextlib.suppress(Exception):
            subprocess.run(
                [*self._base(), "system", "reset", "--force"],
                env=self._environ(), capture_output=True, timeout=60, check=False,
            )
        self._unmount_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV, "") == "1":
        raise AssertionError(f"{REQUIRE_ENV}=1 but the Podman test engine is unavailable: {reason}")
    raise SkipTest(reason)


def _shutdown() -> None:
    if _env is not None:
        _env.shutdown()


def require_podman() -> PodmanEnv:
    """The shared Podman service (started on first use), or a skip with the reason."""
    global _env, _env_error
    if _env is not None:
        if not _env.running:
            _env.start()
        return _env
    if _env_error is not None:
        _unavailable(_env_error)
    if os.geteuid() != 0:
        _env_error = "the Podman test engine runs as root (podman system service)"
    elif shutil.which("podman") is None:
        _env_error = "podman is not installed (Debian package podman)"
    elif shutil.which("busybox") is None:
        _env_error = "busybox is not installed (Debian package busybox-static)"
    if _env_error is not None:
        _unavailable(_env_error)
    env = PodmanEnv()
    try:
        env.start()
        env.ensure_busybox()
        probe = env.client().containers.run(
            BUSYBOX, ["true"], network_mode="host", remove=False, detach=True
        )
        result = probe.wait(timeout=60)
        probe.remove(force=True)
        if result.get("StatusCode") != 0:
            raise RuntimeError(f"a test container exited with {result}")
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        env.shutdown()
        _env_error = f"could not start a container on Podman: {exc}"
        _unavailable(_env_error)
    _env = env
    atexit.register(_shutdown)
    return env

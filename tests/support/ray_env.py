"""
What the Ray tests need: the Ray runtime test bundle image and a second private Docker engine.

L{require_ray_image} builds the image once (C{tests/support/rayimage/build.sh}: debootstrap +
C{ray[serve]==2.58.0} + the helper CLI, cached by content hash under
C{/var/cache/llmport-tests/ray-image}; minutes the first time, nothing after) and returns the
root file system tar. L{import_ray_image} loads it into an engine with C{docker import}
(same tar, so the same RootFS diff id, and so the same rootfs digest, on every engine; the
config ids differ, as they do between two real nodes that loaded the image separately).

L{require_second_docker} starts one more dockerd (a L{DockerEnv} of its own), stopped by PID
at exit like the first. Without root, debootstrap or the package index the tests skip with a
one-line reason, unless C{LLMPORT_REQUIRE_RAY=1} (CI), which makes that a failure.

Test infrastructure: blocks while building and starting (once per process).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from typing import Any

from twisted.trial.unittest import SkipTest

from tests.support.docker_env import DockerEnv, require_docker

REQUIRE_ENV = "LLMPORT_REQUIRE_RAY"
BUILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rayimage", "build.sh")
IMAGE = "llmport-test/ray-runtime:2.58.0"

_tar: str | None = None
_error: str | None = None
_second: DockerEnv | None = None
_second_error: str | None = None


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV, "") == "1":
        raise AssertionError(f"{REQUIRE_ENV}=1 but the Ray test image is unavailable: {reason}")
    raise SkipTest(reason)


def ray_image_path() -> str:
    """Where the cached tar is (or will be), without building."""
    out = subprocess.run(["bash", BUILD_SCRIPT, "--print-path"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def require_ray_image() -> str:
    """The Ray runtime test image tar (built on first use, cached across runs)."""
    global _tar, _error
    if _tar is not None:
        return _tar
    if _error is not None:
        _unavailable(_error)
    if os.geteuid() != 0:
        _error = "the Ray test image needs root (debootstrap, chroot)"
    elif shutil.which("debootstrap") is None:
        _error = "debootstrap is not installed (Debian package debootstrap)"
    if _error is None:
        proc = subprocess.run(["bash", BUILD_SCRIPT], capture_output=True, text=True, timeout=1800)
        path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not os.path.isfile(path):
            _error = f"building the Ray test image failed: {proc.stderr.strip()[-600:]}"
        else:
            _tar = path
    if _error is not None:
        _unavailable(_error)
    assert _tar is not None
    return _tar


def import_ray_image(env: DockerEnv, tar: str) -> dict[str, Any]:
    """Import the tar as L{IMAGE} into C{env} unless it is there; its inspect answer."""
    import docker

    api = env.client().api
    try:
        return dict(api.inspect_image(IMAGE))
    except docker.errors.NotFound:
        pass
    repo, tag = IMAGE.rsplit(":", 1)
    subprocess.run(
        ["docker", "-H", env.host, "import", tar, IMAGE], check=True, capture_output=True, timeout=600
    )
    return dict(api.inspect_image(IMAGE))


def _shutdown() -> None:
    if _second is not None:
        _second.shutdown()


def require_second_docker() -> DockerEnv:
    """A second private engine (the first is L{require_docker}'s), started on first use."""
    global _second, _second_error
    require_docker()
    if _second is not None:
        if not _second.running:
            _second.start()
        return _second
    if _second_error is not None:
        _unavailable(_second_error)
    env = DockerEnv()
    try:
        env.start()
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        env.shutdown()
        _second_error = f"could not start a second Docker test engine: {exc}"
        _unavailable(_second_error)
    _second = env
    atexit.register(_shutdown)
    return env

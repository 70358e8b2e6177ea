"""
The Ray runtime test image as an air-gapped llm-port backend holds it: a C{docker save} tar
(what C{GET /api/node-files/images/save} serves), made from the root file system tar that
L{tests.support.ray_env.require_ray_image} builds, without any engine: one layer (the rootfs
tar itself), an image config pinning it, a manifest naming L{AIRGAP_IMAGE}. Cached next to the
rootfs tar (written to a temporary name, then renamed), so it is made once per image build.

Test infrastructure: blocks (hashes and copies ~650 MB the first time); call it on a thread.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile

from llmport_agent.devbackend.imagetar import image_identity

#: The name the air-gapped tests pin (never the name tests/support/ray_env.py imports).
AIRGAP_IMAGE = "llmport-test/ray-runtime-airgap:2.58.0"
_CHUNK = 4 * 1024 * 1024


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def save_tar(rootfs_tar: str) -> tuple[str, str, str]:
    """C{(path, image id, rootfs digest)} of the C{docker save} tar of C{rootfs_tar}."""
    path = rootfs_tar[: -len(".tar")] + "-airgap-save.tar"
    if os.path.isfile(path):
        image_id, rootfs = image_identity(path)
        if image_id and rootfs:
            return path, image_id, rootfs
    layer = _sha256(rootfs_tar)
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "2026-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer}"]},
        "history": [{"created": "2026-01-01T00:00:00Z", "created_by": "llmport tests: the Ray runtime rootfs"}],
    }, sort_keys=True).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [AIRGAP_IMAGE],
                            "Layers": [f"{layer}/layer.tar"]}]).encode()
    repo, tag = AIRGAP_IMAGE.rsplit(":", 1)
    fd, tmp = tempfile.mkstemp(prefix=".airgap-save-", dir=os.path.dirname(path))
    os.close(fd)
    try:
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            info = tarfile.TarInfo(f"{layer}/layer.tar")
            info.size = os.path.getsize(rootfs_tar)
            info.mtime = 0
            info.mode = 0o644
            with open(rootfs_tar, "rb") as f:
                tar.addfile(info, f)
            _add_bytes(tar, f"{config_id}.json", config)
            _add_bytes(tar, "manifest.json", manifest)
            _add_bytes(tar, "repositories", json.dumps({repo: {tag: layer}}).encode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    image_id, rootfs = image_identity(path)
    assert image_id == f"sha256:{config_id}" and rootfs, (image_id, rootfs)
    return path, image_id, rootfs

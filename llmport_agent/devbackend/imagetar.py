"""
The identity of a C{docker save} tar, for the stand-in's image-save route: the image id (the
SHA-256 of the image's config) and its rootfs digest (protocol 10.6: C{sha256:} of the RootFS
diff ids joined by newlines), read from C{manifest.json} and the config inside the tar.
Blocking (reads the tar's headers): call it before the reactor runs, or on a thread.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from typing import Any

#: manifest.json and the config are small; anything bigger is not a docker save.
_MAX_JSON = 4 * 1024 * 1024


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | None:
    if not member.isfile() or member.size > _MAX_JSON:
        return None
    handle = tar.extractfile(member)
    return None if handle is None else handle.read(_MAX_JSON + 1)


def image_identity(path: str) -> tuple[str | None, str | None]:
    """C{(image id, rootfs digest)} of the first image in the tar, C{(None, None)} if unknown."""
    try:
        with tarfile.open(path, "r:") as tar:
            members = {m.name.lstrip("./"): m for m in tar.getmembers()}
            manifest_member = members.get("manifest.json")
            if manifest_member is None:
                return None, None
            raw = _read(tar, manifest_member)
            manifest: Any = json.loads(raw or b"null")
            if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
                return None, None
            config_name = str(manifest[0].get("Config") or "").lstrip("./")
            config_member = members.get(config_name)
            if config_member is None:
                return None, None
            config_raw = _read(tar, config_member)
    except (OSError, tarfile.TarError, ValueError):
        return None, None
    if config_raw is None:
        return None, None
    image_id = "sha256:" + hashlib.sha256(config_raw).hexdigest()
    try:
        config = json.loads(config_raw)
        layers = [str(x) for x in ((config.get("rootfs") or {}).get("diff_ids") or [])]
    except (ValueError, AttributeError):
        return image_id, None
    if not layers:
        return image_id, None
    return image_id, "sha256:" + hashlib.sha256("\n".join(layers).encode()).hexdigest()

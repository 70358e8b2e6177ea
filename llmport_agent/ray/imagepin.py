"""
The image pin of a runtime bundle (protocol 10.4, 10.6): is the image on this node the one
the bundle certifies?

An image matches, in this order, by its rootfs digest (sha256 of its RootFS diff ids joined
by C{\\n}: two nodes can hold the same layers under different config ids, and the layers
decide), by its config id (C{digest}), or by a repo digest. The answer is a L{PinReport};
L{require_match} turns a missing image into C{runtime_image_missing} and a different one
into C{runtime_image_mismatch}.

L{image_identity} is a thread function for L{DockerEngine.call}; the rest is pure.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule
from llmport_agent.core.values import frozen

from ..commands.base import CommandFailed

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

RUNTIME_IMAGE_MISSING = "runtime_image_missing"
RUNTIME_IMAGE_MISMATCH = "runtime_image_mismatch"


def rootfs_digest(diff_ids: Sequence[str]) -> str:
    """C{sha256:} of the ordered RootFS diff ids joined by C{\\n} (the backend's definition)."""
    return "sha256:" + hashlib.sha256("\n".join(diff_ids).encode("utf-8")).hexdigest()


@frozen
class Identity:
    """What the engine says of a local image (C{present} false when it has none by that name)."""

    present: bool
    image_id: str = ""
    repo_digests: tuple[str, ...] = ()
    diff_ids: tuple[str, ...] = ()

    @property
    def rootfs_digest(self) -> str | None:
        return rootfs_digest(self.diff_ids) if self.diff_ids else None


@frozen
class PinReport:
    """The outcome of a check: C{matched_by} is C{None} when the image is absent or differs."""

    identity: Identity
    matched_by: str | None

    def result(self, image: str, handler: str) -> dict[str, Any]:
        """The C{ensure_runtime_image} result fields (protocol 10.6)."""
        return {
            "verified": self.matched_by is not None,
            "present": self.identity.present,
            "matched_by": self.matched_by,
            "image": image,
            "image_id": self.identity.image_id or None,
            "rootfs_digest": self.identity.rootfs_digest,
            "repo_digests": list(self.identity.repo_digests),
            "runtime_handler": handler,
        }


def image_identity(client: docker.DockerClient, name: str) -> Identity:
    """Thread function: the identity of local image C{name} (absent: C{present=False})."""
    try:
        info = client.api.inspect_image(name)
    except docker.errors.NotFound:
        return Identity(False)
    layers = (info.get("RootFS") or {}).get("Layers") or []
    return Identity(
        True,
        str(info.get("Id") or ""),
        tuple(str(d) for d in (info.get("RepoDigests") or [])[:64]),
        tuple(str(x) for x in layers[:1024]),
    )


def match(identity: Identity, digest: str, rootfs: str | None, repo_digest: str | None) -> str | None:
    """How C{identity} satisfies the pin (C{rootfs_digest}, C{image_id}, C{repo_digest}), or C{None}."""
    if not identity.present:
        return None
    if rootfs is not None and identity.rootfs_digest == rootfs:
        return "rootfs_digest"
    if identity.image_id and identity.image_id.lower() == digest:
        return "image_id"
    if repo_digest is not None and any(d.rsplit("@", 1)[-1].lower() == repo_digest for d in identity.repo_digests):
        return "repo_digest"
    return None


def check(identity: Identity, digest: str, rootfs: str | None, repo_digest: str | None) -> PinReport:
    return PinReport(identity, match(identity, digest, rootfs, repo_digest))


def require_match(report: PinReport, image: str, digest: str, rootfs: str | None, *, why: str = "") -> PinReport:
    """
    @raise CommandFailed: C{runtime_image_missing} (absent) or C{runtime_image_mismatch}
        (present, a different build); C{result} carries the report's fields.
    """
    if report.matched_by is not None:
        return report
    fields = report.result(image, "docker")
    if not report.identity.present:
        raise CommandFailed(
            RUNTIME_IMAGE_MISSING,
            f"The runtime image {image} is not present on this node{why}. ensure_runtime_image "
            "without fetch: false loads it from the llm-port server (or a peer); an operator can "
            "also docker load the certified build.",
            fields,
        )
    raise CommandFailed(
        RUNTIME_IMAGE_MISMATCH,
        f"The runtime image {image} on this node is a different build than the bundle pins "
        f"(local id {report.identity.image_id or 'unknown'}, rootfs "
        f"{report.identity.rootfs_digest or 'unknown'}; pinned id {digest}, rootfs {rootfs or 'unset'}){why}. "
        "ensure_runtime_image without fetch: false loads the pinned build from the llm-port server "
        "(or a peer); an operator can also docker load the certified build.",
        fields,
    )


#: The repository of the private names images are loaded under before they are verified.
PRIVATE_REPO = "llmport-agent-verify"


def private_name() -> str:
    """A fresh private C{name:tag} to load an unverified image under (never a bundle's name)."""
    return f"{PRIVATE_REPO}/{secrets.token_hex(8)}:pending"


def drop_name(client: docker.DockerClient, name: str) -> None:
    """
    Thread function: remove the name C{name}. An image no other name holds and no container
    uses goes with it; one that has other names keeps them. Absent is fine.
    """
    try:
        client.api.remove_image(name)
    except docker.errors.NotFound:
        pass


def adopt(
    client: docker.DockerClient,
    private: str,
    repository: str,
    tag: str,
    digest: str,
    rootfs: str | None,
    repo_digest: str | None,
) -> PinReport:
    """
    Thread function: check the image loaded under the private name C{private} against the
    pin; only when it matches is it named C{repository:tag} (by its id, so nothing can swap
    it in between). The private name is removed either way: a foreign build is left with no
    name of the bundle's, and is deleted when nothing else names or uses it.
    """
    try:
        report = check(image_identity(client, private), digest, rootfs, repo_digest)
        if report.matched_by is not None:
            client.api.tag(report.identity.image_id, repository, tag, force=True)
    finally:
        drop_name(client, private)
    return report

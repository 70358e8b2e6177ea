"""
Hostile image archives for C{transfer_from_server}: the backend (or whoever sits between it
and the node) serves a C{docker save} tar that names more than the requested reference, or
hides a metadata file behind PAX headers, long names or symlinks. The archive may create or
move no tag but the requested one: it fails with C{image_transfer_failed} naming what it tried, and
every tag on the host stays where it was.

The first class runs on the real engine (the engine's own tar reader and loader decide what a
tag points at); the second drives the filter directly with archives that a Go tar reader would
interpret in a way a naive Python reader would not.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads.policy import parse_image_ref
from llmport_agent.workloads.tarfilter import (
    MAX_METADATA_BYTES,
    ImageTarFilter,
    TarRejected,
)
from tests.support.docker_env import BUSYBOX, DockerEnv
from tests.support.imageserver import ImageSaveResource, serve, stop_serving
from tests.support.rig import Rig, WorkloadTestBase, httpd_payload

reactor: Any = _global_reactor

CREDENTIAL = "0b7f3f0e-0000-4000-8000-000000000002.h0stile-node-credential-value-abcdefghijk"


def variant(env: DockerEnv, repo: str, tag: str, marker: str) -> str:
    """A new image (busybox with an extra ENV) tagged C{repo:tag}; returns its id."""
    api = env.client().api
    cid = api.create_container(BUSYBOX, command=["true"])["Id"]
    try:
        result = api.commit(cid, repository=repo, tag=tag, changes=[f"ENV LLMPORT_VARIANT={marker}"])
    finally:
        api.remove_container(cid, force=True)
    return str(result["Id"])


def image_id(env: DockerEnv, ref: str) -> str | None:
    import docker

    try:
        return str(env.client().api.inspect_image(ref)["Id"])
    except docker.errors.NotFound:
        return None


def members(data: bytes) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            f = tar.extractfile(m) if m.isfile() else None
            out.append((m, f.read() if f is not None else None))
    return out


def build(items: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in items:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def raw(info: tarfile.TarInfo, data: bytes = b"", fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    """One member as raw blocks (header(s), data, padding), without an end marker."""
    return info.tobuf(fmt) + data + bytes(-len(data) % 512)


END = bytes(1024)


def prefixed_member(name: str, prefix: str, data: bytes, version: bytes = b"\x00\x00") -> bytes:
    """
    One raw ustar member whose C{prefix} field is set and whose version is not C{00}: Go's
    reader (the engine's) joins the prefix whenever the magic is C{ustar\\0}, whatever the
    version says, so the engine reads it as C{prefix/name}.
    """
    info = tarfile.TarInfo(name)
    info.size = len(data)
    block = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    encoded = prefix.encode()
    block[345 : 345 + len(encoded)] = encoded
    block[263:265] = version
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block[:512])
    return bytes(block) + data + bytes(-len(data) % 512)


def file_info(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


class TransferAttackTests(WorkloadTestBase):
    """The real engine: tags on the host must not move."""

    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        self.resource = ImageSaveResource(reactor, CREDENTIAL)
        self.port, self.base_url = await serve(reactor, self.resource)
        self.addCleanup(lambda: stop_serving(self.port, self.resource))
        await self.rig.stop()
        self.rig = Rig(reactor, self.env, backend_url=self.base_url, credential=lambda: CREDENTIAL)
        await self.rig.start()
        suffix = uuid.uuid4().hex[:6]
        self.allowed = f"allowed/app-{suffix}"
        self.victim = f"victim/service-{suffix}"
        api = self.env.client().api
        # The node's own image, tagged victim/...:prod before the attack.
        self.victim_id = variant(self.env, self.victim, "prod", "node-original")
        # The backend's content, saved under the requested tag *and* the victim's tag.
        self.evil_id = variant(self.env, self.allowed, "1", "backend-content")
        api.tag(self.evil_id, self.victim, "prod-evil")
        api.tag(self.evil_id, self.victim, "prod", force=True)
        self.tar = b"".join(self._save_both())
        self.clean_tar = b"".join(api.get_image(f"{self.allowed}:1"))
        # Put the node back as it was: the victim tag on its original image, no allowed tag.
        api.tag(self.victim_id, self.victim, "prod", force=True)
        api.remove_image(f"{self.victim}:prod-evil")
        api.remove_image(f"{self.allowed}:1")
        self.addCleanup(self._cleanup)
        self.assertEqual(image_id(self.env, f"{self.victim}:prod"), self.victim_id)

    def _save_both(self) -> list[bytes]:
        # docker-py has no multi-reference save; the engine API has (names=...).
        api = self.env.client().api
        response = api._get(
            api._url("/images/get"),
            params={"names": [f"{self.allowed}:1", f"{self.victim}:prod"]},
            stream=True,
        )
        api._raise_for_status(response)
        return list(response.iter_content(64 * 1024))

    def _cleanup(self) -> None:
        for ref in (f"{self.allowed}:1", f"{self.victim}:prod", f"{self.victim}:prod-evil"):
            self.env.remove_image(ref)
        for ident in (self.evil_id, self.victim_id):
            self.env.remove_image(ident)

    def serve_tar(self, data: bytes) -> None:
        self.resource.tars[(self.allowed, "1")] = data

    async def transfer_fails(self) -> CommandFailed:
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(f"{self.allowed}:1"), lambda *a, **k: None)
        return cm.exception

    def assert_untouched(self) -> None:
        self.assertEqual(image_id(self.env, f"{self.victim}:prod"), self.victim_id)
        self.assertIsNone(image_id(self.env, f"{self.allowed}:1"))

    async def test_extra_repo_tag_of_an_existing_image(self) -> None:
        """
        The tar served for allowed/app:1 also carries the RepoTag victim/service:prod, an image
        that exists on the node. The transfer fails naming the victim, and victim/service:prod
        still points at the node's own image.
        """
        manifest = json.loads(dict((m.name, d) for m, d in members(self.tar))["manifest.json"] or b"")
        self.assertEqual(sorted(manifest[0]["RepoTags"]), sorted([f"{self.allowed}:1", f"{self.victim}:prod"]))
        self.serve_tar(self.tar)
        exc = await self.transfer_fails()
        self.assertEqual(exc.error_code, "image_transfer_failed")
        self.assertIn(f"{self.victim}:prod", exc.error_message)
        self.assert_untouched()

    async def test_only_the_victim_named(self) -> None:
        """The tar served for allowed/app:1 names only victim/service:prod."""
        items = []
        for m, d in members(self.tar):
            if m.name == "manifest.json":
                doc = json.loads(d or b"")
                doc[0]["RepoTags"] = [f"{self.victim}:prod"]
                items.append(file_info("manifest.json", json.dumps(doc).encode()))
            elif m.name == "repositories":
                items.append(file_info("repositories", json.dumps({self.victim: {"prod": "x"}}).encode()))
            else:
                items.append((m, d))
        self.serve_tar(build(items, tarfile.USTAR_FORMAT))
        exc = await self.transfer_fails()
        self.assertIn(f"{self.victim}:prod", exc.error_message)
        self.assert_untouched()

    async def test_legacy_repositories_file(self) -> None:
        """
        No manifest.json: the engine falls back to the legacy `repositories` file, which names
        the victim. Refused.
        """
        items = [(m, d) for m, d in members(self.tar) if m.name != "manifest.json"]
        self.serve_tar(build(items, tarfile.USTAR_FORMAT))
        exc = await self.transfer_fails()
        self.assertIn(f"{self.victim}:prod", exc.error_message)
        self.assert_untouched()

    async def test_manifest_hidden_behind_a_pax_path(self) -> None:
        """
        The manifest is stored as a member called `notes.txt` whose PAX header says its path is
        manifest.json (the engine's Go reader honours the PAX path). Refused all the same.
        """
        items: list[tuple[tarfile.TarInfo, bytes | None]] = []
        for m, d in members(self.tar):
            if m.name == "manifest.json":
                info, data = file_info("notes.txt", d or b"")
                info.pax_headers = {"path": "manifest.json"}
                items.append((info, data))
            elif m.name != "repositories":
                items.append((m, d))
        self.serve_tar(build(items, tarfile.PAX_FORMAT))
        exc = await self.transfer_fails()
        self.assertIn(f"{self.victim}:prod", exc.error_message)
        self.assert_untouched()

    async def test_manifest_hidden_in_a_ustar_prefix(self) -> None:
        """
        A clean archive (only the requested tag), then a trailing member called `.` whose ustar
        prefix is `manifest.json` and whose version is not `00`: the engine reads it as
        manifest.json (Go joins the prefix whenever the magic is `ustar\\0`) and its RepoTags
        win. The transfer fails and the victim tag has not moved.
        """
        items = [(m, d) for m, d in members(self.tar) if m.name != "repositories"]
        good: list[tuple[tarfile.TarInfo, bytes | None]] = []
        evil = b""
        for m, d in items:
            if m.name == "manifest.json":
                doc = json.loads(d or b"")
                evil = json.dumps(doc).encode()
                doc[0]["RepoTags"] = [f"{self.allowed}:1"]
                good.append(file_info("manifest.json", json.dumps(doc).encode()))
            else:
                good.append((m, d))
        archive = b"".join(raw(m, d or b"") for m, d in good)
        for version in (b"\x00\x00", b"  "):
            self.serve_tar(archive + prefixed_member(".", "manifest.json", evil, version) + END)
            try:
                await self.rig.manager.images.transfer(
                    parse_image_ref(f"{self.allowed}:1"), lambda *a, **k: None)
            except CommandFailed as exc:
                self.assertEqual(exc.error_code, "image_transfer_failed")
            self.assertEqual(image_id(self.env, f"{self.victim}:prod"), self.victim_id)
            self.env.remove_image(f"{self.allowed}:1")

    async def test_docker_py_transport_filters_too(self) -> None:
        """Where the engine is reached through docker-py (TLS, ssh), the same filter applies."""
        from llmport_agent.workloads import imageload

        self.patch(imageload, "_raw_connection", lambda api: None)
        self.serve_tar(self.tar)
        exc = await self.transfer_fails()
        self.assertIn(f"{self.victim}:prod", exc.error_message)
        self.assert_untouched()
        self.serve_tar(self.clean_tar)
        result = await self.rig.manager.images.transfer(parse_image_ref(f"{self.allowed}:1"), lambda *a, **k: None)
        self.assertEqual(result["image_id"], self.evil_id)

    async def test_clean_archive_still_loads(self) -> None:
        """The same image saved under the requested tag only loads and runs (the filter passes it)."""
        self.serve_tar(self.clean_tar)
        payload = httpd_payload(image=f"{self.allowed}:1", image_source="transfer_from_server")
        _, result = await self.rig.run("deploy_workload", payload)
        self.assertEqual(result["image_id"], self.evil_id)
        self.assertEqual(image_id(self.env, f"{self.victim}:prod"), self.victim_id)


def docker_save_like(tags: list[str], extra: list[tuple[tarfile.TarInfo, bytes | None]] | None = None) -> bytes:
    """A small archive shaped like `docker save` output (one layer) naming C{tags}."""
    layer_id = "a" * 64
    config = "b" * 64 + ".json"
    layer = build([file_info("hello.txt", b"hi\n")], tarfile.USTAR_FORMAT)
    d = tarfile.TarInfo(layer_id)
    d.type = tarfile.DIRTYPE
    items: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (d, None),
        file_info(f"{layer_id}/VERSION", b"1.0"),
        file_info(f"{layer_id}/json", b"{}"),
        file_info(f"{layer_id}/layer.tar", layer),
        file_info(config, b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'),
    ]
    items.extend(extra or [])
    items.append(file_info("manifest.json", json.dumps(
        [{"Config": config, "RepoTags": tags, "Layers": [f"{layer_id}/layer.tar"]}]).encode()))
    items.append(file_info("repositories", json.dumps(
        {t.rsplit(":", 1)[0]: {t.rsplit(":", 1)[1]: layer_id} for t in tags}).encode()))
    return build(items, tarfile.USTAR_FORMAT)


def run_filter(data: bytes, chunk: int = 4096, requested: str = "allowed/app:1", load_as: str | None = None) -> bytes:
    f = ImageTarFilter(requested, lambda t: parse_image_ref(t).canonical, load_as)
    out: list[bytes] = []
    for i in range(0, len(data), chunk):
        out.extend(bytes(p) for p in f.feed(data[i : i + chunk]))
    out.extend(bytes(p) for p in f.finish())
    return b"".join(out)


class TarFilterTests(SynchronousTestCase):
    """The filter alone, with archives built to fool a reader that is not Go's."""

    def assertRejected(self, data: bytes, *needles: str) -> str:
        with self.assertRaises(TarRejected) as cm:
            run_filter(data)
        for needle in needles:
            self.assertIn(needle, str(cm.exception))
        return str(cm.exception)

    def test_clean_archive_passes_unchanged_but_for_metadata(self) -> None:
        """Every member but the metadata passes byte for byte, at any chunking."""
        data = docker_save_like(["allowed/app:1"])
        for chunk in (1, 100, 512, 513, 65536):
            out = run_filter(data, chunk)
            got = {m.name: d for m, d in members(out)}
            want = {m.name: d for m, d in members(data)}
            self.assertEqual(set(got), set(want))
            for name in want:
                if name not in ("manifest.json", "repositories"):
                    self.assertEqual(got[name], want[name], name)
            self.assertEqual(json.loads(got["manifest.json"] or b"")[0]["RepoTags"], ["allowed/app:1"])

    def test_docker_hub_spellings_are_the_same_reference(self) -> None:
        """docker.io/allowed/app:1 in the archive is the requested allowed/app:1."""
        out = run_filter(docker_save_like(["docker.io/allowed/app:1"]))
        got = {m.name: d for m, d in members(out)}
        self.assertEqual(json.loads(got["manifest.json"] or b"")[0]["RepoTags"], ["allowed/app:1"])

    def test_extra_tag(self) -> None:
        self.assertRejected(docker_save_like(["allowed/app:1", "victim/service:prod"]), "victim/service:prod")

    def test_other_tag_of_the_same_repository(self) -> None:
        self.assertRejected(docker_save_like(["allowed/app:2"]), "allowed/app:2")

    def test_digest_reference(self) -> None:
        self.assertRejected(docker_save_like(["allowed/app@sha256:" + "c" * 64]), "sha256")

    def test_case_variant_key_that_go_would_read(self) -> None:
        """
        Go's JSON decoder matches `repotags` to RepoTags; a reader that only looks at the exact
        key would miss the victim. The rewritten manifest carries only what was checked.
        """
        data = docker_save_like(["allowed/app:1"])
        items = []
        for m, d in members(data):
            if m.name == "manifest.json":
                doc = json.loads(d or b"")
                doc[0]["repotags"] = ["victim/service:prod"]
                del doc[0]["RepoTags"]
                d = json.dumps(doc).encode()
                m.size = len(d)
            items.append((m, d))
        self.assertRejected(build(items, tarfile.USTAR_FORMAT), "victim/service:prod")

    def test_two_spellings_of_one_field(self) -> None:
        data = docker_save_like(["allowed/app:1"])
        items = []
        for m, d in members(data):
            if m.name == "manifest.json":
                d = d.replace(b'"RepoTags"', b'"repoTags":["victim/service:prod"],"RepoTags"')  # type: ignore[union-attr]
                m.size = len(d or b"")
            items.append((m, d))
        self.assertRejected(build(items, tarfile.USTAR_FORMAT), "RepoTags")

    def test_unknown_keys_are_dropped(self) -> None:
        """Keys Go would not decode do not reach the engine (e.g. a key with a Unicode fold)."""
        data = docker_save_like(["allowed/app:1"])
        items = []
        for m, d in members(data):
            if m.name == "manifest.json":
                doc = json.loads(d or b"")
                doc[0]["RepoTag\u017f"] = ["victim/service:prod"]
                d = json.dumps(doc).encode()
                m.size = len(d)
            items.append((m, d))
        got = {m.name: d for m, d in members(run_filter(build(items, tarfile.USTAR_FORMAT)))}
        self.assertNotIn(b"victim", got["manifest.json"] or b"")

    def test_two_images_in_the_manifest(self) -> None:
        data = docker_save_like(["allowed/app:1"])
        items = []
        for m, d in members(data):
            if m.name == "manifest.json":
                doc = json.loads(d or b"")
                doc.append(dict(doc[0], RepoTags=[]))
                d = json.dumps(doc).encode()
                m.size = len(d)
            items.append((m, d))
        self.assertRejected(build(items, tarfile.USTAR_FORMAT), "2 images")

    def test_second_manifest_member_wins_in_go(self) -> None:
        """A good manifest.json, then another one (the engine keeps the last) naming the victim."""
        extra = [file_info("manifest.json", json.dumps(
            [{"Config": "x.json", "RepoTags": ["allowed/app:1"], "Layers": []}]).encode())]
        data = docker_save_like(["allowed/app:1"])
        # Append a second manifest.json after the first, before the end marker.
        items = members(data) + [file_info("manifest.json", json.dumps(
            [{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode())]
        self.assertRejected(build(extra + items, tarfile.USTAR_FORMAT), "victim/service:prod")

    def test_pax_path(self) -> None:
        info, data = file_info("notes.txt", json.dumps(
            [{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode())
        info.pax_headers = {"path": "manifest.json"}
        self.assertRejected(build([(info, data)], tarfile.PAX_FORMAT), "victim/service:prod")

    def test_gnu_long_name(self) -> None:
        """A GNU long-name header renames the next member to manifest.json."""
        name = "x" * 150 + "/../manifest.json"
        info, data = file_info(name, json.dumps(
            [{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode())
        self.assertRejected(build([(info, data)], tarfile.GNU_FORMAT), "victim/service:prod")

    def test_pax_size_changes_the_member_boundary(self) -> None:
        """
        A PAX `size` of 0 for `notes.txt` whose ustar header claims more: Go follows PAX, so
        what a naive reader takes for the data of notes.txt is a manifest.json member.
        """
        evil = json.dumps([{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode()
        inner = raw(file_info("manifest.json", evil)[0], evil)
        info = tarfile.TarInfo("notes.txt")
        info.pax_headers = {"size": "0"}
        info.size = len(inner)  # what the ustar header says
        header = info.tobuf(tarfile.PAX_FORMAT)
        self.assertRejected(header + inner + END, "victim/service:prod")

    def test_symlink_named_manifest(self) -> None:
        link = tarfile.TarInfo("manifest.json")
        link.type = tarfile.SYMTYPE
        link.linkname = "evil.json"
        evil = file_info("evil.json", b"[]")
        self.assertRejected(build([evil, (link, None)], tarfile.USTAR_FORMAT), "manifest.json is not a regular file")

    def test_symlinks_docker_save_does_not_write(self) -> None:
        for name, target in (("evil", "/etc/passwd"), ("a/layer.tar", "../../x/layer.tar"), ("x/y", "../z")):
            link = tarfile.TarInfo(name)
            link.type = tarfile.SYMTYPE
            link.linkname = target
            self.assertRejected(docker_save_like(["allowed/app:1"], [(link, None)]), "symlink")

    def test_directory_symlink_then_manifest_below_it(self) -> None:
        """`d -> .` then `d/manifest.json`: the engine would write it to manifest.json."""
        link = tarfile.TarInfo("d")
        link.type = tarfile.SYMTYPE
        link.linkname = "."
        self.assertRejected(build([(link, None), file_info("d/manifest.json", b"[]")], tarfile.USTAR_FORMAT), "symlink")

    def test_layer_links_of_docker_save_are_accepted(self) -> None:
        """docker save links duplicate layers as `<id>/layer.tar -> ../<id>/layer.tar`."""
        link = tarfile.TarInfo("c" * 64 + "/layer.tar")
        link.type = tarfile.SYMTYPE
        link.linkname = "../" + "a" * 64 + "/layer.tar"
        d = tarfile.TarInfo("c" * 64)
        d.type = tarfile.DIRTYPE
        out = run_filter(docker_save_like(["allowed/app:1"], [(d, None), (link, None)]))
        self.assertIn("c" * 64 + "/layer.tar", [m.name for m, _ in members(out)])

    def test_layer_links_of_podman_save_are_accepted(self) -> None:
        """Podman's save links each layer as `<id>/layer.tar -> ../<sha256 hex>.tar`; nothing wider."""
        d = tarfile.TarInfo("c" * 64)
        d.type = tarfile.DIRTYPE
        link = tarfile.TarInfo("c" * 64 + "/layer.tar")
        link.type = tarfile.SYMTYPE
        link.linkname = "../" + "a" * 64 + ".tar"
        out = run_filter(docker_save_like(["allowed/app:1"], [(d, None), (link, None)]))
        self.assertIn("c" * 64 + "/layer.tar", [m.name for m, _ in members(out)])
        for target in ("../manifest.json", "../" + "a" * 63 + ".tar", "../x/" + "a" * 64 + ".tar",
                       "../../" + "a" * 64 + ".tar"):
            bad = tarfile.TarInfo("c" * 64 + "/layer.tar")
            bad.type = tarfile.SYMTYPE
            bad.linkname = target
            self.assertRejected(docker_save_like(["allowed/app:1"], [(d, None), (bad, None)]), "symlink")

    def test_member_directly_below_an_accepted_layer_link(self) -> None:
        """
        `<id>/layer.tar -> ../<id>/layer.tar` is accepted; `<id>/layer.tar/x` after it would be
        written through the link (as would a hard link naming it): both refused.
        """
        d = tarfile.TarInfo("c" * 64)
        d.type = tarfile.DIRTYPE
        link = tarfile.TarInfo("c" * 64 + "/layer.tar")
        link.type = tarfile.SYMTYPE
        link.linkname = "../" + "a" * 64 + "/layer.tar"
        below = file_info("c" * 64 + "/layer.tar/x", b"x")
        self.assertRejected(docker_save_like(["allowed/app:1"], [(d, None), (link, None), below]),
                            "below a symlink")
        hard = tarfile.TarInfo("h")
        hard.type = tarfile.LNKTYPE
        hard.linkname = "c" * 64 + "/layer.tar/x"
        self.assertRejected(docker_save_like(["allowed/app:1"], [(d, None), (link, None), (hard, None)]),
                            "below a symlink")

    def test_hard_link_to_outside_the_archive(self) -> None:
        """A hard link whose target leaves the archive's root (`../outside`) is refused."""
        for target in ("../outside", "a/../../outside", "./../outside"):
            hard = tarfile.TarInfo("h")
            hard.type = tarfile.LNKTYPE
            hard.linkname = target
            self.assertRejected(docker_save_like(["allowed/app:1"], [(hard, None)]),
                                "hard link pointing outside")

    def test_manifest_that_is_a_hard_link(self) -> None:
        evil = file_info("evil.json", b"[]")
        link = tarfile.TarInfo("manifest.json")
        link.type = tarfile.LNKTYPE
        link.linkname = "evil.json"
        self.assertRejected(build([evil, (link, None)], tarfile.USTAR_FORMAT), "not a regular file")

    def test_member_below_manifest(self) -> None:
        self.assertRejected(build([file_info("manifest.json/x", b"")], tarfile.USTAR_FORMAT), "below")

    def test_escaping_member(self) -> None:
        for name in ("../manifest.json", "a/../../manifest.json"):
            info, data = file_info(name, b"[]")
            self.assertRejected(raw(info, data) + END, "outside")

    def test_absolute_manifest_path_is_the_manifest(self) -> None:
        """The engine writes `/manifest.json` and `./manifest.json` to manifest.json."""
        for name in ("/manifest.json", "./manifest.json", "a/../manifest.json"):
            info, data = file_info(name, json.dumps(
                [{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode())
            self.assertRejected(raw(info, data) + END, "victim/service:prod")

    def test_oversized_metadata(self) -> None:
        big = b"[" + b" " * (MAX_METADATA_BYTES + 10) + b"]"
        self.assertRejected(build([file_info("manifest.json", big)], tarfile.USTAR_FORMAT), "more than")

    def test_bad_checksum(self) -> None:
        data = bytearray(docker_save_like(["allowed/app:1"]))
        data[0] ^= 0x01
        self.assertRejected(bytes(data), "checksum")

    def test_lone_zero_block(self) -> None:
        """One empty block then more members: Go stops with an error; never a half-checked archive."""
        first = raw(*file_info("a", b"x"))
        evil = json.dumps([{"Config": "x.json", "RepoTags": ["allowed/app:1"], "Layers": []}]).encode()
        self.assertRejected(first + bytes(512) + raw(*file_info("manifest.json", evil)) + END, "empty block")

    def test_no_manifest(self) -> None:
        self.assertRejected(build([file_info("a", b"x")], tarfile.USTAR_FORMAT), "no manifest.json")

    def test_truncated(self) -> None:
        data = docker_save_like(["allowed/app:1"])
        self.assertRejected(data[: len(data) // 2 + 7], "ended")

    def test_sparse_and_unknown_types(self) -> None:
        info, data = file_info("x", b"abc")
        info.type = b"S"
        self.assertRejected(build([(info, data)], tarfile.GNU_FORMAT), "type")

    def test_oci_index_annotations(self) -> None:
        """On the containerd image store the names come from index.json annotations."""
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": "sha256:" + "d" * 64, "size": 10,
                "annotations": {"io.containerd.image.name": "docker.io/victim/service:prod",
                                "org.opencontainers.image.ref.name": "prod"},
            }],
        }
        data = build([file_info("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                      file_info("index.json", json.dumps(index).encode())], tarfile.USTAR_FORMAT)
        self.assertRejected(data, "victim/service:prod")
        index["manifests"][0]["annotations"] = {  # type: ignore[index]
            "io.containerd.image.name": "docker.io/allowed/app:1", "org.opencontainers.image.ref.name": "1"}
        data = build([file_info("index.json", json.dumps(index).encode())], tarfile.USTAR_FORMAT)
        got = {m.name: d for m, d in members(run_filter(data))}
        ann = json.loads(got["index.json"] or b"")["manifests"][0]["annotations"]
        self.assertEqual(ann["io.containerd.image.name"], "docker.io/allowed/app:1")

    def test_load_as_a_private_name(self) -> None:
        """
        load_as: the archive is checked against the requested name, but the engine is told
        only the private name (manifest, repositories, OCI annotations): an unverified image
        never takes the requested name.
        """
        private = "llmport-agent-verify/0123456789abcdef:pending"
        got = {m.name: d for m, d in members(run_filter(docker_save_like(["allowed/app:1"]), load_as=private))}
        self.assertEqual(json.loads(got["manifest.json"] or b"")[0]["RepoTags"], [private])
        self.assertEqual(json.loads(got["repositories"] or b""),
                         {"llmport-agent-verify/0123456789abcdef": {"pending": "a" * 64}})
        with self.assertRaises(TarRejected):
            run_filter(docker_save_like(["victim/service:prod"]), load_as=private)
        index = {"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + "d" * 64, "size": 10,
            "annotations": {"io.containerd.image.name": "docker.io/allowed/app:1",
                            "org.opencontainers.image.ref.name": "1"}}]}
        data = build([file_info("index.json", json.dumps(index).encode())], tarfile.USTAR_FORMAT)
        got = {m.name: d for m, d in members(run_filter(data, load_as=private))}
        ann = json.loads(got["index.json"] or b"")["manifests"][0]["annotations"]
        self.assertEqual(ann["io.containerd.image.name"], "docker.io/" + private)
        self.assertEqual(ann["org.opencontainers.image.ref.name"], "pending")
        self.assertNotIn(b"allowed/app", got["index.json"] or b"")

    def test_nothing_after_the_end_marker_is_sent(self) -> None:
        data = docker_save_like(["allowed/app:1"])
        trailer = build([file_info("manifest.json", b"[]")], tarfile.USTAR_FORMAT)
        out = run_filter(data + trailer)
        self.assertNotIn(b"[]", out[-2048:])
        self.assertEqual(out[-1024:], bytes(1024))


def raw_headers(data: bytes) -> list[bytes]:
    """Every header block of an archive (framing read from the ustar size field only)."""
    out, pos = [], 0
    while pos + 512 <= len(data):
        block = data[pos : pos + 512]
        if block == bytes(512):
            break
        out.append(block)
        size_field = block[124:136]
        size = int.from_bytes(size_field, "big") & ~(1 << 95) if size_field[0] & 0x80 else int(
            size_field.strip(b" \x00") or b"0", 8)
        pos += 512 + size + (-size % 512)
    return out


class CanonicalRebuildTests(SynchronousTestCase):
    """What reaches the engine is a rebuilt archive: fresh headers that say what was checked."""

    def test_prefix_joined_whatever_the_version(self) -> None:
        """Go joins the ustar prefix whenever the magic is `ustar\\0`: `.` + prefix = manifest.json."""
        evil = json.dumps([{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode()
        good = docker_save_like(["allowed/app:1"])
        body = b"".join(raw(m, d or b"") for m, d in members(good))
        for version in (b"\x00\x00", b"  ", b"00", b"x\x00"):
            data = body + prefixed_member(".", "manifest.json", evil, version) + END
            with self.assertRaises(TarRejected, msg=repr(version)) as cm:
                run_filter(data)
            self.assertIn("victim/service:prod", str(cm.exception))

    def test_every_header_is_fresh_and_canonical(self) -> None:
        """
        Extension headers, prefixes, extra PAX records, GNU long names and global headers of the
        archive never reach the engine: each member gets one ustar header with no prefix, and a
        PAX header only for a name or link too long for its field (holding only path/linkpath).
        """
        layer_dir = "a" * 64
        long_dir = "d" * 120
        items: list[tuple[tarfile.TarInfo, bytes | None]] = []
        info, data = file_info(f"{long_dir}/notes.txt", b"hello")
        info.pax_headers = {"SCHILY.xattr.security.capability": "x", "uname": "root", "comment": "c"}
        items.append((info, data))
        d = tarfile.TarInfo(long_dir)
        d.type = tarfile.DIRTYPE
        items.insert(0, (d, None))
        pax_part = build(items, tarfile.PAX_FORMAT)
        gnu_part = build([file_info("g" * 130, b"gnu")], tarfile.GNU_FORMAT)
        glob = tarfile.TarInfo("global")
        glob.type = tarfile.XGLTYPE
        glob_block = glob.tobuf(tarfile.PAX_FORMAT)
        prefixed = prefixed_member("file.txt", "somewhere", b"p", b"00")
        clean = docker_save_like(["allowed/app:1"])

        def body(archive: bytes) -> bytes:
            return b"".join(raw(m, dd or b"", tarfile.PAX_FORMAT) for m, dd in members(archive))

        data = body(pax_part) + body(gnu_part) + glob_block + prefixed + body(clean) + END
        out = run_filter(data)
        got = {m.name: dd for m, dd in members(out)}
        self.assertEqual(got[f"{long_dir}/notes.txt"], b"hello")
        self.assertEqual(got["g" * 130], b"gnu")
        self.assertEqual(got["somewhere/file.txt"], b"p")
        self.assertEqual(got[f"{layer_dir}/VERSION"], b"1.0")
        pax_values = []
        for block in raw_headers(out):
            self.assertEqual(block[257:265], b"ustar\x0000")
            self.assertEqual(block[345:500], bytes(155), "a prefix reached the engine")
            self.assertIn(block[156:157], (b"0", b"5", b"x"))
            if block[156:157] == b"x":
                pax_values.append(block)
        self.assertEqual(len(pax_values), 3)  # the three long names, nothing else
        for m, _ in members(out):
            self.assertLessEqual(set(m.pax_headers), {"path", "linkpath"})
            self.assertEqual((m.uid, m.gid, m.uname, m.gname), (0, 0, "", ""))

    def test_devices_and_fifos_refused(self) -> None:
        for kind in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
            dev = tarfile.TarInfo("a" * 64 + "/layer.tar")
            dev.type = kind
            dev.devmajor, dev.devminor = 8, 0
            with self.assertRaises(TarRejected) as cm:
                run_filter(docker_save_like(["allowed/app:1"], [(dev, None)]))
            self.assertIn("device or FIFO", str(cm.exception))

    def test_empty_gnu_long_name_keeps_the_header_name(self) -> None:
        """Go ignores an empty GNU long name: the member keeps its own (checked) name."""
        evil = json.dumps([{"Config": "x.json", "RepoTags": ["victim/service:prod"], "Layers": []}]).encode()
        longname = tarfile.TarInfo("././@LongLink")
        longname.type = tarfile.GNUTYPE_LONGNAME
        longname.size = 0
        header = longname.tobuf(tarfile.GNU_FORMAT)
        member = raw(file_info("manifest.json", evil)[0], evil)
        with self.assertRaises(TarRejected) as cm:
            run_filter(header + member + END)
        self.assertIn("victim/service:prod", str(cm.exception))

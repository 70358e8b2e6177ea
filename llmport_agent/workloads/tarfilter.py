"""
A streaming filter for the C{docker save} tar of C{transfer_from_server}: the archive may
create or move no tag but the one requested.

The engine's image load takes its tags from the archive's metadata members: C{manifest.json}
(C{RepoTags}), C{repositories} (the legacy format, read when there is no manifest.json) and, on
engines with the containerd image store, C{index.json} (OCI annotations). A backend (or whoever
stands between it and the node) could name any reference there and so replace any image on the
host. L{ImageTarFilter} sits between the download and the engine and:

 - rebuilds every other member's header: what reaches the engine is a fresh, canonical header
   (ustar, no prefix, a PAX record only for a name, link or size that does not fit) carrying
   exactly the name, type, link and size the filter read and checked, followed by the
   member's data as slices of the arriving buffers (no copy). The archive's own headers,
   extension headers (PAX, GNU long names, global headers) and fields the filter does not
   need never reach the engine, so no difference between this reader and Go's can make the
   engine see a member the filter did not;
 - holds back each metadata member (small, bounded by L{MAX_METADATA_BYTES}, wherever in the
   archive it comes: C{docker save} puts them at the end), checks every reference it names
   against the requested one, and sends a rewritten, canonical copy (what the engine reads is
   exactly what was checked: no parser differences such as Go's case-insensitive JSON keys);
 - refuses what could smuggle a metadata member past it: symlinks other than the layer links
   C{docker save} writes, members below a symlink, metadata members that are not regular
   files, sparse files, devices, FIFOs, unknown member types, a bad header checksum, a lone
   end block;
 - interprets PAX (C{path}, C{linkpath}, C{size}) and GNU long-name headers the way Go's
   C{archive/tar} (the engine's reader) does, so a member's real name and size are the ones
   checked.

A refused archive raises L{TarRejected} before its end-of-archive marker is sent: the caller
aborts the upload, the engine's load fails, and no tag on the host changes.

Pure: no I/O; runs on the loading thread.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_METADATA_BYTES", "ImageTarFilter", "TarRejected"]

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)

#: The largest metadata member (manifest.json, repositories, index.json) held back for checking.
MAX_METADATA_BYTES = 4 * 1024 * 1024
#: The largest PAX or GNU long-name extension header held back.
MAX_EXTENSION_BYTES = 1024 * 1024
#: At most this many symlinks are remembered (members below one are refused).
MAX_SYMLINKS = 100_000

#: A layer blob at the top of a Podman docker-archive (C{podman save}, its compat API's save).
_PODMAN_LAYER = re.compile(r"[0-9a-f]{64}\.tar")

MANIFEST = "manifest.json"
REPOSITORIES = "repositories"
INDEX = "index.json"
METADATA = frozenset({MANIFEST, REPOSITORIES, INDEX})

# Go archive/tar: entries whose data is never read, whatever the size field says.
_HEADER_ONLY = frozenset(b"123456")
_REGULAR = frozenset(b"07\x00")
_KNOWN = _REGULAR | _HEADER_ONLY | frozenset(b"xgLK")
# Devices and FIFOs: docker save writes none, and the engine would create them while unpacking.
_SPECIAL = frozenset(b"346")
#: The largest number an 11-digit octal size field holds; larger sizes go base-256 (as Go reads).
_OCTAL_MAX = 8**11 - 1

_OCTAL = re.compile(rb"^[0-7]+$")
_IMAGE_NAME_ANNOTATION = "io.containerd.image.name"
_REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"

# manifest.json entries (moby's manifestItem) and OCI index/descriptor fields, as Go spells
# them; Go's encoding/json matches object keys to them case-insensitively.
_MANIFEST_FIELDS = ("Config", "RepoTags", "Layers", "Parent", "LayerSources")
_INDEX_FIELDS = ("schemaVersion", "mediaType", "artifactType", "manifests", "subject", "annotations")
_DESCRIPTOR_FIELDS = (
    "mediaType", "digest", "size", "urls", "annotations", "data", "platform", "artifactType",
)


class TarRejected(Exception):
    """The archive may not be loaded; the message says why (one sentence, for the user)."""


def _cstr(raw: bytes) -> str:
    """A NUL-terminated header field (Go's parseString), decoded leniently."""
    end = raw.find(b"\x00")
    return (raw if end < 0 else raw[:end]).decode("utf-8", "surrogateescape")


def _numeric(raw: bytes) -> int:
    """An octal or base-256 header number (Go's parseNumeric)."""
    if raw and raw[0] & 0x80:
        # Base-256, two's complement; the first byte's top bit is the marker.
        value = raw[0] & 0x7F
        negative = bool(raw[0] & 0x40)
        for b in raw[1:]:
            value = (value << 8) | b
        if negative:
            value -= 1 << (8 * len(raw) - 1)
        return value
    text = raw.strip(b" \x00").split(b"\x00", 1)[0]
    if not text:
        return 0
    if not _OCTAL.match(text):
        raise TarRejected("the archive has a malformed header (a number field is not octal)")
    return int(text, 8)


def _checksum_ok(block: bytes) -> bool:
    stored = _numeric(block[148:156])
    blanked = block[:148] + b" " * 8 + block[156:]
    unsigned = sum(blanked)
    signed = sum(b - 256 if b > 127 else b for b in blanked)
    return stored in (unsigned, signed)


def _parse_pax(data: bytes) -> dict[str, str]:
    """PAX extended header records (C{"%d key=value\\n"}), strictly."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            raise TarRejected("the archive has a malformed PAX header")
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarRejected("the archive has a malformed PAX header") from None
        end = pos + length
        if length <= space - pos + 1 or end > len(data) or data[end - 1 : end] != b"\n":
            raise TarRejected("the archive has a malformed PAX header")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq:
            raise TarRejected("the archive has a malformed PAX header")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return records


def _clean(name: str) -> str:
    """
    The path the engine writes a member to, relative to the archive root (Go's
    C{filepath.Clean}, then C{Join} with the destination: a leading C{/} is dropped, a leading
    C{..} escapes).
    """
    clean = posixpath.normpath(name) if name else "."
    if clean.startswith("/"):
        clean = clean.lstrip("/") or "."
    return clean


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _pax_record(key: str, value: bytes) -> bytes:
    body = b" " + key.encode() + b"=" + value + b"\n"
    length = len(body) + 1
    while len(b"%d" % length) + len(body) != length:
        length = len(b"%d" % length) + len(body)
    return b"%d" % length + body


def _header_block(name: bytes, flag: bytes, size: int, linkname: bytes, mode: int, mtime: int) -> bytes:
    block = bytearray(BLOCK)
    block[0 : len(name)] = name
    block[100:108] = b"%07o\x00" % mode
    block[108:116] = b"0000000\x00"
    block[116:124] = b"0000000\x00"
    if size <= _OCTAL_MAX:
        block[124:136] = b"%011o\x00" % size
    else:  # base-256, as Go's writer and reader do for large sizes
        block[124:136] = (size | (1 << 95)).to_bytes(12, "big")
    block[136:148] = b"%011o\x00" % mtime
    block[156:157] = flag
    block[157 : 157 + len(linkname)] = linkname
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def canonical_header(
    name: str, flag: int = ord("0"), size: int = 0, linkname: str = "", mode: int = 0o644, mtime: int = 0
) -> bytes:
    """
    A fresh header for one member, as the engine must read it: a ustar block with no prefix,
    preceded by a PAX header (C{path}, C{linkpath}) only when the name or link does not fit its
    field. C{name} and C{linkname} hold no NUL (checked by the caller).
    """
    raw_name, raw_link = _encode(name), _encode(linkname)
    records = b""
    if len(raw_name) > 100:
        records += _pax_record("path", raw_name)
        raw_name = raw_name[:100]
    if len(raw_link) > 100:
        records += _pax_record("linkpath", raw_link)
        raw_link = raw_link[:100]
    mtime = min(max(mtime, 0), _OCTAL_MAX)
    header = _header_block(raw_name, bytes([flag]), size, raw_link, mode & 0o777, mtime)
    if not records:
        return header
    pax = _header_block(b"PaxHeaders/" + raw_name[:80], b"x", len(records), b"", 0o644, mtime)
    return pax + records + bytes(_padding(len(records))) + header


def _ustar_header(name: str, size: int) -> bytes:
    """A fresh USTAR header for a regular file of C{size} bytes (the rewritten metadata)."""
    return canonical_header(name, ord("0"), size)


def _padding(size: int) -> int:
    return -size % BLOCK


def _pick(obj: dict[str, Any], fields: tuple[str, ...], what: str) -> dict[str, Any]:
    """
    The fields Go would decode from C{obj} (keys matched case-insensitively), under their
    canonical spelling. Two keys that Go would both map to one field are refused.
    """
    lower = {f.lower(): f for f in fields}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        canonical = lower.get(key.lower())
        if canonical is None:
            continue
        if canonical in out:
            raise TarRejected(f"the archive's {what} spells the field {canonical} twice")
        out[canonical] = value
    return out


class ImageTarFilter:
    """
    Feed the archive in with L{feed} (any chunking), send what it returns, in order, to the
    engine; call L{finish} at the end of the download and send what it returns too.

    @param requested: the reference requested, in the engine's form (C{name:tag}).
    @param normalize: maps a reference found in the archive to the engine's form, or raises
        C{ValueError} when it is not a valid reference.
    @param load_as: the reference the engine is to give the image instead of C{requested}
        (C{name:tag}; the archive is still checked against C{requested}): a private name
        under which an image is verified before it may take C{requested}.
    """

    def __init__(self, requested: str, normalize: Callable[[str], str], load_as: str | None = None) -> None:
        self.requested = requested
        self._normalize = normalize
        #: What the rewritten metadata names.
        self.load_as = load_as or requested
        self._name, _, self._tag = self.load_as.rpartition(":")
        self._requested_tag = requested.rpartition(":")[2]
        self._header = bytearray()
        self._state = "header"
        self._remaining = 0  # bytes of the current member's data (with padding) still to come
        self._collect = bytearray()
        self._collect_size = 0
        self._collect_kind = ""  # "pax", "longname", "longlink", "metadata"
        self._collect_name = ""
        # Whether extension headers are waiting for the member they describe (their meaning:
        # _pax, _longname, _longlink; their bytes are never sent).
        self._pending = False
        self._pax: dict[str, str] = {}
        self._longname: str | None = None
        self._longlink: str | None = None
        self._zero_seen = False
        self._symlinks: set[str] = set()
        self.members = 0
        self.metadata_seen: set[str] = set()
        self.rewritten = 0
        self.bytes_in = 0
        self.done = False

    # -- input -----------------------------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """Take the next bytes of the archive; return what may go to the engine now."""
        view = memoryview(data)
        size = len(view)
        self.bytes_in += size
        out: list[bytes | memoryview] = []
        pos = 0
        while pos < size:
            state = self._state
            if state == "pass":
                n = min(self._remaining, size - pos)
                out.append(view[pos : pos + n])
                pos += n
                self._remaining -= n
                if not self._remaining:
                    self._state = "header"
            elif state == "skip":  # data the engine does not need (a global PAX header's)
                n = min(self._remaining, size - pos)
                pos += n
                self._remaining -= n
                if not self._remaining:
                    self._state = "header"
            elif state == "collect":
                n = min(self._remaining, size - pos)
                self._collect += view[pos : pos + n]
                pos += n
                self._remaining -= n
                if not self._remaining:
                    self._state = "header"
                    self._collected(out)
            elif state == "header":
                n = min(BLOCK - len(self._header), size - pos)
                self._header += view[pos : pos + n]
                pos += n
                if len(self._header) == BLOCK:
                    block = bytes(self._header)
                    self._header.clear()
                    self._on_header(block, out)
            else:  # "end": whatever follows the end-of-archive marker is not sent
                pos = size
        return out

    def finish(self) -> list[bytes | memoryview]:
        """The download ended: check the archive was complete and allowed."""
        if not self.done:
            if self._state != "header" or self._header or self._pending:
                raise TarRejected("the archive from the backend ended in the middle of a member")
            # Go's reader accepts an archive without its end marker; the engine still needs one.
            self._finish_checks()
            self.done = True
            return [ZERO_BLOCK, ZERO_BLOCK]
        return []

    # -- headers ---------------------------------------------------------------------------

    def _on_header(self, block: bytes, out: list[bytes | memoryview]) -> None:
        if block == ZERO_BLOCK:
            if self._zero_seen:
                if self._pending:
                    raise TarRejected("the archive ends with an extension header that describes nothing")
                self._finish_checks()
                out.append(ZERO_BLOCK)
                out.append(ZERO_BLOCK)
                self._state = "end"
                self.done = True
            self._zero_seen = True
            return
        if self._zero_seen:
            raise TarRejected("the archive has an empty block in the middle (a corrupt or spliced archive)")
        if not _checksum_ok(block):
            raise TarRejected("the archive has a header with a wrong checksum (a corrupt archive)")
        flag = block[156]
        if flag in _SPECIAL:
            raise TarRejected("the archive holds a device or FIFO member (docker save writes none)")
        if flag not in _KNOWN:
            kind = chr(flag) if 32 < flag < 127 else f"0x{flag:02x}"
            raise TarRejected(f"the archive holds a member of an unsupported type ({kind!r})")
        size = _numeric(block[124:136])
        if size < 0:
            raise TarRejected("the archive has a header with a negative size")
        if flag in b"xgLK":
            self._extension(block, flag, size, out)
            return
        self.members += 1
        name = self._member_name(block)
        pax, self._pax = self._pax, {}
        longname, self._longname = self._longname, None
        longlink, self._longlink = self._longlink, None
        if "path" in pax:
            name = pax["path"]
        if longname:  # Go: an empty GNU long name changes nothing
            name = longname
        linkname = _cstr(block[157:257])
        if "linkpath" in pax:
            linkname = pax["linkpath"]
        if longlink:
            linkname = longlink
        if "size" in pax:
            try:
                size = int(pax["size"], 10)
            except ValueError:
                raise TarRejected("the archive has a PAX size that is not a number") from None
            if size < 0:
                raise TarRejected("the archive has a negative PAX size")
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise TarRejected("the archive holds a sparse file (not produced by docker save)")
        if "\x00" in name or "\x00" in linkname:
            raise TarRejected("the archive has a member name with a NUL byte in it")
        self._pending = False
        if flag == 0 and name.endswith("/"):
            flag = ord("5")  # Go: a legacy regular entry whose name ends in "/" is a directory
        data = 0 if flag in _HEADER_ONLY else size
        clean = _clean(name)
        if clean == ".." or clean.startswith("../"):
            raise TarRejected(f"the archive holds a member outside its root ({name[:120]!r})")
        self._check_path(clean, name)
        top = clean.split("/", 1)[0]
        if top in METADATA and clean != top:
            raise TarRejected(f"the archive holds {name[:120]!r} below its metadata file {top}")
        if clean in METADATA:
            if flag not in _REGULAR:
                raise TarRejected(f"the archive's {clean} is not a regular file")
            if data > MAX_METADATA_BYTES:
                raise TarRejected(
                    f"the archive's {clean} is {data} bytes, more than the {MAX_METADATA_BYTES} "
                    "this node accepts"
                )
            # Held back (its extension headers are dropped): checked, then rewritten.
            self._begin_collect("metadata", data, clean, out)
            return
        if flag == ord("2"):
            self._check_symlink(clean, name, linkname)
        elif flag == ord("1"):
            target = _clean(linkname)
            if target == ".." or target.startswith("../"):
                raise TarRejected(f"the archive holds a hard link pointing outside it ({name[:120]!r})")
            self._check_path(target, linkname)
        # A fresh header saying exactly what was checked; the archive's own headers stay here.
        out_flag = ord("0") if flag in _REGULAR else flag
        out_name = clean + "/" if flag == ord("5") and clean != "." else clean
        try:
            mode = _numeric(block[100:108])
            mtime = _numeric(block[136:148])
        except TarRejected:
            mode, mtime = 0o644, 0
        out.append(canonical_header(out_name, out_flag, data, linkname, mode, mtime))
        self._begin_pass(data)

    def _member_name(self, block: bytes) -> str:
        """
        The header's own name, as Go's archive/tar reads it: the prefix is joined whenever the
        magic is C{ustar\\0} (whatever the version field holds); a star archive (trailer
        C{tar\\0}) has a shorter prefix; a GNU or v7 header has none.
        """
        name = _cstr(block[0:100])
        if block[257:263] == b"ustar\x00":
            prefix = _cstr(block[345:476] if block[508:512] == b"tar\x00" else block[345:500])
            if prefix:
                name = prefix + "/" + name
        return name

    def _extension(self, block: bytes, flag: int, size: int, out: list[bytes | memoryview]) -> None:
        if flag == ord("g"):
            # Go returns global headers as entries of their own (the engine skips them); what
            # extension headers came before describe nothing any more. Not sent.
            self._pending = False
            self._pax, self._longname, self._longlink = {}, None, None
            self._remaining = size + _padding(size)
            self._state = "skip" if self._remaining else "header"
            return
        if size > MAX_EXTENSION_BYTES:
            raise TarRejected(f"the archive has an extension header of {size} bytes (at most {MAX_EXTENSION_BYTES})")
        self._pending = True
        kind = {ord("x"): "pax", ord("L"): "longname", ord("K"): "longlink"}[flag]
        self._begin_collect(kind, size, "", out)

    def _begin_pass(self, data: int) -> None:
        self._remaining = data + _padding(data)
        self._state = "pass" if self._remaining else "header"

    def _begin_collect(self, kind: str, data: int, name: str, out: list[bytes | memoryview]) -> None:
        self._collect = bytearray()
        self._collect_size = data
        self._collect_kind = kind
        self._collect_name = name
        self._remaining = data + _padding(data)
        if self._remaining:
            self._state = "collect"
        else:
            self._collected(out)

    def _collected(self, out: list[bytes | memoryview]) -> None:
        raw = bytes(self._collect[: self._collect_size])
        self._collect = bytearray()
        kind = self._collect_kind
        if kind == "metadata":
            self._metadata(self._collect_name, raw, out)
            return
        if kind == "pax":
            self._pax = _parse_pax(raw)  # the latest PAX header wins (as in Go)
        elif kind == "longname":
            self._longname = _cstr(raw)
        else:
            self._longlink = _cstr(raw)

    # -- rules -----------------------------------------------------------------------------

    def _check_path(self, clean: str, name: str) -> None:
        """Refuse a path that goes through a symlink of the archive."""
        if not self._symlinks:
            return
        parts = clean.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self._symlinks:
                raise TarRejected(f"the archive holds {name[:120]!r} below a symlink")

    def _check_symlink(self, clean: str, name: str, linkname: str) -> None:
        """
        Only the layer links docker save writes (C{<id>/layer.tar -> ../<id>/layer.tar} or a
        blob) and Podman's save writes (C{<id>/layer.tar -> ../<sha256 hex>.tar}) are accepted:
        nothing else, so no metadata file and no directory is a link.
        """
        parts = clean.split("/")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(clean), linkname))
        ok = (
            len(parts) == 2
            and parts[1] == "layer.tar"
            and not linkname.startswith("/")
            and not (target == ".." or target.startswith("../"))
            and (
                (target.endswith("/layer.tar") and target.count("/") == 1)
                or (target.startswith("blobs/") and target.count("/") == 2)
                or _PODMAN_LAYER.fullmatch(target) is not None
            )
        )
        if not ok:
            raise TarRejected(
                f"the archive holds a symlink {name[:120]!r} -> {linkname[:120]!r}, which docker "
                "save does not write"
            )
        if len(self._symlinks) >= MAX_SYMLINKS:
            raise TarRejected(f"the archive holds more than {MAX_SYMLINKS} symlinks")
        self._symlinks.add(clean)

    def _finish_checks(self) -> None:
        if MANIFEST not in self.metadata_seen and REPOSITORIES not in self.metadata_seen and (
            INDEX not in self.metadata_seen
        ):
            raise TarRejected(
                "the archive holds no manifest.json (it is not a docker save archive)"
            )

    def _metadata(self, name: str, raw: bytes, out: list[bytes | memoryview]) -> None:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise TarRejected(f"the archive's {name} is not valid JSON") from None
        if name == MANIFEST:
            new: Any = self._manifest(doc)
        elif name == REPOSITORIES:
            new = self._repositories(doc)
        else:
            new = self._index(doc)
        body = json.dumps(new, separators=(",", ":")).encode() + b"\n"
        self.metadata_seen.add(name)
        self.rewritten += 1
        out.append(_ustar_header(name, len(body)))
        out.append(body + bytes(_padding(len(body))))

    def _foreign(self, names: list[str], where: str) -> None:
        if not names:
            return
        shown = ", ".join(n[:120] for n in sorted(set(names))[:5])
        more = len(set(names)) - 5
        if more > 0:
            shown += f" and {more} more"
        raise TarRejected(
            f"the archive from the backend names {shown} (in its {where}), but only "
            f"{self.requested} was requested: nothing was loaded and no tag on this node changed"
        )

    def _is_requested(self, ref: str) -> bool:
        try:
            return self._normalize(ref) == self.requested
        except ValueError:
            return False

    def _manifest(self, doc: Any) -> list[dict[str, Any]]:
        if not isinstance(doc, list) or not all(isinstance(e, dict) for e in doc):
            raise TarRejected("the archive's manifest.json is not a list of image entries")
        if len(doc) != 1:
            raise TarRejected(
                f"the archive's manifest.json describes {len(doc)} images; only {self.requested} "
                "was requested"
            )
        entry = _pick(doc[0], _MANIFEST_FIELDS, "manifest.json")
        tags = entry.get("RepoTags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise TarRejected("the archive's manifest.json has RepoTags that are not a list of names")
        self._foreign([t for t in tags if not self._is_requested(t)], "manifest.json RepoTags")
        entry["RepoTags"] = [self.load_as]
        return [entry]

    def _repositories(self, doc: Any) -> dict[str, dict[str, str]]:
        if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
            raise TarRejected("the archive's repositories file is not a map of names to tags")
        foreign = []
        image_id = None
        for repo, tags in doc.items():
            for tag, ident in tags.items():
                if not isinstance(ident, str):
                    raise TarRejected("the archive's repositories file has a tag that is not an image id")
                if self._is_requested(f"{repo}:{tag}"):
                    image_id = ident
                else:
                    foreign.append(f"{repo}:{tag}")
        self._foreign(foreign, "repositories file")
        return {} if image_id is None else {self._name: {self._tag: image_id}}

    def _index(self, doc: Any) -> dict[str, Any]:
        if not isinstance(doc, dict):
            raise TarRejected("the archive's index.json is not an object")
        index = _pick(doc, _INDEX_FIELDS, "index.json")
        foreign: list[str] = []
        index_ann = index.get("annotations")
        if index_ann is not None:
            index["annotations"] = self._annotations(index_ann, foreign)
        manifests = index.get("manifests") or []
        if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
            raise TarRejected("the archive's index.json manifests are not a list of descriptors")
        clean = []
        for m in manifests:
            desc = _pick(m, _DESCRIPTOR_FIELDS, "index.json")
            if desc.get("annotations") is not None:
                desc["annotations"] = self._annotations(desc["annotations"], foreign)
            clean.append(desc)
        if "manifests" in index:
            index["manifests"] = clean
        self._foreign(foreign, "index.json annotations")
        return index

    def _annotations(self, ann: Any, foreign: list[str]) -> dict[str, str]:
        if not isinstance(ann, dict) or not all(isinstance(v, str) for v in ann.values()):
            raise TarRejected("the archive's index.json has annotations that are not a map of strings")
        out = dict(ann)
        name = ann.get(_IMAGE_NAME_ANNOTATION)
        if name is not None:
            if self._is_requested(name):
                out[_IMAGE_NAME_ANNOTATION] = self._docker_io(self.load_as)
            else:
                foreign.append(name)
        ref = ann.get(_REF_NAME_ANNOTATION)
        if ref is not None:
            if ref != self._requested_tag and not self._is_requested(ref):
                foreign.append(ref)
            elif self.load_as != self.requested:
                # Never the requested name by another way (a bare tag that an engine completes).
                out[_REF_NAME_ANNOTATION] = self._tag if ref == self._requested_tag else self.load_as
        return out

    @staticmethod
    def _docker_io(ref: str) -> str:
        first = ref.split("/", 1)[0]
        if "/" in ref and ("." in first or ":" in first or first == "localhost"):
            return ref
        return "docker.io/" + (ref if "/" in ref.split(":", 1)[0] else "library/" + ref)


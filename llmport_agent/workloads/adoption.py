"""
Taking over the original agent's runtimes (issue 20 #6).

The original agent names its containers C{llm-port-<slug>}, puts no labels on them, and keeps
the runtime -> container mapping in the state file under C{workloads} (C{{runtime_id:
{container_name, container_id, image, ...}}}), a file written by root, not by containers. This
agent acts only on containers it labelled, and the engine cannot add labels to an existing
container. So at start it reads that mapping and adopts exactly the containers that

  - exist under the name the mapping gives, and that name starts with C{llm-port-};
  - carry no labels of another manager (a container labelled by this agent is its own anyway);
  - were created from the image the mapping names (the container's C{Config.Image}), and are
    the container the mapping names when it recorded an id;
  - bind no host path inside a directory containers write (the model store, the Ray session
    directory): the engine resolves a mount's source again at every start, so a directory
    there swapped for a link would be followed when this agent starts or restarts it. (The
    original binds the model store itself, which is fine.)

Everything else is refused and said in the log, one line each. Adopted containers are recorded
in the state file (C{adopted}: runtime id -> container id, name, image) and managed like the
agent's own: found for stop, start, restart, logs, remove and health, and replaced by a labelled
container at their next deploy or update.

The original's keys stay in the state file, and C{workloads} is kept current for every runtime
this agent deploys, updates or removes (the container's name, id and image), so the original
agent, started again on this state, finds its runtimes where they are.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from attrs import field
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from llmport_agent.core.lazyimport import LazyModule
from llmport_agent.core.values import define, frozen

from . import containers as ops
from .labels import LABEL_AGENT_ID, LABEL_MANAGED, MANAGED_VALUE

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

#: A recorded container id: the engine's short (12) or full (64) hex id, or anything between.
_ID_RE = re.compile(r"\A[0-9a-fA-F]{12,64}\Z")

#: The original agent's container name prefix.
ORIGINAL_PREFIX = "llm-port-"
#: The most mapping entries looked at (the original keeps one per runtime of the node).
MAX_ENTRIES = 500
#: Retry of an adoption pass that could not reach the engine.
RETRY_SEC = 30.0


@frozen
class Candidate:
    runtime_id: str
    container_name: str
    image: str
    container_id: str | None


@frozen
class Verdict:
    """What one candidate came to: adopted (with the container's full id) or refused (why)."""

    candidate: Candidate
    container_id: str | None = None
    refused: str | None = None


def _same_image(recorded: str, actual: str) -> bool:
    """C{busybox} and C{busybox:latest} name the same image; C{docker.io/} is implied."""

    def norm(ref: str) -> str:
        ref = ref.strip()
        for prefix in ("docker.io/library/", "docker.io/"):
            if ref.startswith(prefix):
                ref = ref[len(prefix):]
        last = ref.rsplit("/", 1)[-1]
        if "@" not in ref and ":" not in last:
            ref += ":latest"
        return ref

    return bool(recorded) and norm(recorded) == norm(actual)


def candidates(state: Mapping[str, Any]) -> tuple[list[Candidate], list[str]]:
    """
    The original's mapping as candidates, and a line for each entry that is not even one
    (malformed: it is never acted on).
    """
    raw = state.get("workloads")
    if not isinstance(raw, Mapping):
        return [], []
    from .policy import PolicyError, check_container_name, check_runtime_id

    out: list[Candidate] = []
    bad: list[str] = []
    for n, (runtime_id, entry) in enumerate(raw.items()):
        if n >= MAX_ENTRIES:
            bad.append(f"{len(raw) - MAX_ENTRIES} more entries not looked at (at most {MAX_ENTRIES})")
            break
        try:
            rid = check_runtime_id(runtime_id)
            if not isinstance(entry, Mapping):
                raise PolicyError("the entry is not an object")
            name = check_container_name(entry.get("container_name"))
            image = entry.get("image")
            if not isinstance(image, str) or not image.strip() or len(image) > 512:
                raise PolicyError("it names no image")
            cid = entry.get("container_id")
            cid = cid.strip() if isinstance(cid, str) and cid.strip() else None
        except PolicyError as e:
            bad.append(f"runtime {str(runtime_id)[:80]!r}: {e}")
            continue
        out.append(Candidate(rid, name, image.strip(), cid))
    return out, bad


def judge(
    client: docker.DockerClient, candidate: Candidate, agent_id: str, container_written: tuple[str, ...] = ()
) -> Verdict:
    """
    Thread function: adopt or refuse one candidate (see the module docstring).

    @param container_written: host directories containers write (the model store, the Ray
        session directory): a bind source strictly inside one refuses the candidate.
    """
    c = candidate
    if not c.container_name.startswith(ORIGINAL_PREFIX):
        return Verdict(c, refused=f"its name {c.container_name} does not start with {ORIGINAL_PREFIX}")
    snap = ops.by_exact_name(client, c.container_name)
    if snap is None:
        return Verdict(c, refused=f"no container {c.container_name} exists")
    labels = snap["labels"]
    if labels.get(LABEL_MANAGED) == MANAGED_VALUE:
        if labels.get(LABEL_AGENT_ID) == agent_id:
            return Verdict(c, refused="it is already this agent's own (labelled) container")
        return Verdict(c, refused=f"it is labelled as managed by agent {labels.get(LABEL_AGENT_ID)!r}")
    if not _same_image(c.image, snap["image"]):
        return Verdict(c, refused=f"it was created from image {snap['image'][:200]!r}, not {c.image[:200]!r} "
                                  "as the mapping says")
    if c.container_id and not _ID_RE.match(c.container_id):
        return Verdict(c, refused=f"the mapping's container id {c.container_id[:80]!r} is not 12 to 64 hex "
                                  "characters (the engine's short or full id)")
    if c.container_id and not snap["id"].startswith(c.container_id.lower()):
        return Verdict(c, refused=f"it is not the container the mapping names (id {c.container_id[:12]}, found "
                                  f"{snap['id'][:12]})")
    for source in snap.get("bind_sources") or []:
        inside = next((w for w in container_written if w and _strictly_inside(source, w)), None)
        if inside is not None:
            return Verdict(c, refused=f"it mounts {source[:200]!r} from inside {inside}, which containers write (the "
                                      "engine resolves a mount's source again at every start, so this agent does not "
                                      "start it); remove it and deploy the runtime again")
    return Verdict(c, container_id=snap["id"])


def _strictly_inside(path: str, root: str) -> bool:
    path, root = os.path.normpath(path), os.path.normpath(root)
    return path != root and path.startswith(root.rstrip("/") + "/")


def judge_all(
    client: docker.DockerClient, cands: list[Candidate], agent_id: str, container_written: tuple[str, ...] = ()
) -> list[Verdict]:
    return [judge(client, c, agent_id, container_written) for c in cands]


def exists(client: docker.DockerClient, ids: list[str]) -> list[str]:
    """Thread function: which of the full container ids still exist."""
    return [cid for cid in ids if ops.inspect(client, cid) is not None]


@define(eq=False, repr=False)  # a component: identity, not value
class Adoption:
    """
    The adopted containers (container id -> runtime id), shared by the workload handlers and
    the health watcher, and the original's C{workloads} mapping kept current.

    @param state: the agent's L{StateStore}.
    @param engine: the L{DockerEngine}.
    """

    reactor: Any
    engine: Any
    state: Any
    agent_id: str
    wallclock: Callable[[], float] = time.time
    #: Host directories containers write (model store, Ray session directory): see L{judge}.
    container_written: tuple[str, ...] = ()
    by_container: dict[str, str] = field(factory=dict)
    _ready: Deferred[None] | None = None
    _waiters: list[Deferred[None]] = field(factory=list)
    _retry: Any = None
    _listeners: list[Callable[[], None]] = field(factory=list)
    log = Logger()

    # -- what the handlers use -----------------------------------------------------------

    def snapshot(self) -> dict[str, str]:
        """container id -> runtime id, a copy (for a thread function)."""
        return dict(self.by_container)

    def runtime_of(self, container_id: str) -> str | None:
        """The runtime of an adopted container (its full id), or C{None}: one lookup, no copy."""
        return self.by_container.get(container_id)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call C{listener()} whenever the set of adopted containers changes (reactor thread)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def _set(self, by_container: dict[str, str]) -> None:
        if by_container == self.by_container:
            return
        self.by_container = by_container
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                self.log.failure("A listener of the adopted containers failed")

    def is_adopted(self, runtime_id: str) -> bool:
        return runtime_id in self.by_container.values()

    def ready(self) -> Deferred[None]:
        """Fires once the first adoption pass is over (at once when it is)."""
        if self._ready is None or self._ready.called:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d

    # -- the pass at start ---------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Adopt what the original's mapping names (and re-check what was adopted before)."""
        self._ready = Deferred.fromCoroutine(self._pass())
        self._ready.addErrback(lambda f: self.log.failure("Adopting the original agent's runtimes failed", f))
        self._ready.addBoth(self._release)
        return self._ready

    def stop(self) -> None:
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None

    def _release(self, _: object) -> None:
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(None)

    async def _pass(self) -> None:
        from .engine import EngineError

        cands, bad = candidates(self.state.data)
        for line in bad:
            self.log.warn("Not adopting an entry of the original agent's workloads: {why}", why=line)
        previous = self.state.get("adopted")
        previous = dict(previous) if isinstance(previous, Mapping) else {}
        if not cands and not previous:
            return
        try:
            verdicts = await self.engine.call(judge_all, cands, self.agent_id, self.container_written,
                                              what="adopting the original agent's containers")
        except EngineError as e:
            self.log.warn("Could not adopt the original agent's runtimes yet ({error}); trying again in "
                          "{sec:.0f} s", error=str(e), sec=RETRY_SEC)
            self._retry = self.reactor.callLater(RETRY_SEC, self.start)
            return
        adopted: dict[str, dict[str, Any]] = {}
        for v in verdicts:
            c = v.candidate
            if v.container_id is None:
                if "already this agent's own" not in (v.refused or ""):
                    self.log.warn(
                        "Not adopting runtime {runtime_id} of the original agent: {why}; it stays as it is "
                        "and is not managed by this agent",
                        runtime_id=c.runtime_id, why=v.refused,
                    )
                continue
            adopted[c.runtime_id] = {"container_id": v.container_id, "container_name": c.container_name,
                                     "image": c.image,
                                     "adopted_at": (previous.get(c.runtime_id) or {}).get("adopted_at")
                                     or self.wallclock()}
            if c.runtime_id not in previous:
                self.log.info(
                    "Adopted runtime {runtime_id} of the original agent: container {name} ({id}, image "
                    "{image}); it is managed as this agent's own and replaced by a labelled container at "
                    "its next deploy or update",
                    runtime_id=c.runtime_id, name=c.container_name, id=v.container_id[:12], image=c.image,
                )
        self._set({rec["container_id"]: rid for rid, rec in adopted.items()})
        if adopted != previous:
            await self.state.update(adopted=adopted or None)
        if adopted:
            self.log.info("{n} runtime(s) of the original agent adopted", n=len(adopted))

    # -- what the handlers report ----------------------------------------------------------

    def deployed(self, runtime_id: str, result: Mapping[str, Any], runtime_name: str | None = None) -> None:
        """
        A deploy, update, start or restart of C{runtime_id} succeeded: an adopted container
        replaced by a new one is no longer adopted, and the original's mapping names what runs.
        """
        cid = result.get("container_id")
        name = result.get("container_name")
        if not isinstance(cid, str) or not isinstance(name, str):
            return
        changes: dict[str, Any] = {}
        old = [c for c, r in self.by_container.items() if r == runtime_id and c != cid]
        if old:
            self._set({c: r for c, r in self.by_container.items() if c not in old})
            adopted = dict(self.state.get("adopted") or {})
            adopted.pop(runtime_id, None)
            changes["adopted"] = adopted or None
            self.log.info("Runtime {runtime_id}: the adopted container was replaced by a labelled one ({name})",
                          runtime_id=runtime_id, name=name)
        workloads = dict(self.state.get("workloads") or {})
        entry = dict(workloads.get(runtime_id) or {})
        entry.update({"container_name": name, "container_id": cid})
        for key in ("image", "host_port", "container_port", "endpoint_url"):
            if result.get(key) is not None:
                entry[key] = str(result[key]) if key.endswith("port") else result[key]
        if runtime_name and "runtime_name" not in entry:
            entry["runtime_name"] = runtime_name
        if workloads.get(runtime_id) != entry:
            workloads[runtime_id] = entry
            changes["workloads"] = workloads
        if changes:
            self.state.note(**changes)

    def removed(self, runtime_id: str) -> None:
        """C{remove_workload} succeeded: nothing of the runtime is left, in either agent's keys."""
        self._set({c: r for c, r in self.by_container.items() if r != runtime_id})
        changes: dict[str, Any] = {}
        adopted = dict(self.state.get("adopted") or {})
        if adopted.pop(runtime_id, None) is not None:
            changes["adopted"] = adopted or None
        workloads = dict(self.state.get("workloads") or {})
        if workloads.pop(runtime_id, None) is not None:
            changes["workloads"] = workloads
        if changes:
            self.state.note(**changes)

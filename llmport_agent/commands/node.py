"""
Node commands (protocol 4): maintenance, drain/resume, profile, inventory refresh, diagnostics,
and the refusals (C{host_op}, system updates).

Maintenance and draining are persisted in the state file, survive restarts and show in the
heartbeat status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from twisted.logger import Logger

from llmport_agent.commands.base import (
    INVALID_COMMAND,
    POLICY_VIOLATION,
    CommandContext,
    CommandFailed,
    HandlerSpec,
)
from llmport_agent.core.state import StateStore

log = Logger()


class PersistentModes:
    """Maintenance/draining flags and the node profile, kept in the state file."""

    def __init__(self, state: StateStore, on_change: Callable[[], None] | None = None) -> None:
        self.state = state
        self.on_change = on_change
        # The profile as received, registry credentials included: memory only. The state file
        # keeps a copy without them; the backend sends the profile again in every hello_ack.
        self._live_profile: dict[str, Any] | None = None

    @property
    def maintenance(self) -> bool:
        return bool(self.state.get("maintenance", False))

    @property
    def draining(self) -> bool:
        return bool(self.state.get("draining", False))

    @property
    def live_profile(self) -> dict[str, Any] | None:
        """The profile as received from the backend since this start (memory only), or C{None}."""
        return self._live_profile

    @property
    def profile(self) -> dict[str, Any] | None:
        if self._live_profile is not None:
            return self._live_profile
        p = self.state.get("profile")
        return p if isinstance(p, dict) else None

    def status(self, degraded: bool = False) -> str:
        """The heartbeat status: maintenance, draining, degraded or healthy."""
        if self.maintenance:
            return "maintenance"
        if self.draining:
            return "draining"
        return "degraded" if degraded else "healthy"

    async def set(self, **flags: Any) -> None:
        if "profile" in flags:
            profile = flags["profile"]
            self._live_profile = profile
            if profile is not None:
                # Scrubbed and measured on the I/O pool: a profile can be megabytes.
                stored, problem = await self.state.runner.run(stored_profile, profile)
                if self._live_profile is not profile:
                    flags.pop("profile")  # a newer profile arrived meanwhile; it is stored instead
                else:
                    if problem is not None:
                        log.warn(
                            "The node profile is kept in memory only, not in the state file: {problem} "
                            "(the backend sends it again at every connect)",
                            problem=problem,
                        )
                    flags["profile"] = stored
        await self.state.update(**flags)
        if self.on_change is not None:
            self.on_change()


#: The largest profile (JSON, registry credentials removed) kept in the state file.
MAX_STORED_PROFILE = 1024 * 1024


def stored_profile(profile: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """
    Thread function: the copy of C{profile} for the state file (registry credentials removed),
    or C{None} and the reason when it is too big or too deep to keep there.
    """
    from llmport_agent.commands.parse import TooDeep, json_size, scrub_for_journal

    try:
        scrubbed = scrub_for_journal(profile)
    except TooDeep as e:
        return None, f"it is {e}"
    size = json_size(scrubbed)
    if size < 0 or size > MAX_STORED_PROFILE:
        return None, f"it is {size} bytes as JSON, more than the {MAX_STORED_PROFILE} stored"
    return scrubbed, None


def parse_enabled(value: Any) -> bool:
    """C{enabled} of set_maintenance_mode: true/false, or the strings true/false/1/0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise CommandFailed(
        INVALID_COMMAND,
        f"field 'payload.enabled' must be true or false (or \"true\"/\"false\"/\"1\"/\"0\"); got {str(value)[:40]!r}",
    )


def node_handler_specs(
    modes: PersistentModes,
    refresh_inventory: Callable[[], Awaitable[bool]],
    diagnostics: Callable[[], Awaitable[dict[str, Any]]],
    check_updates: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> dict[str, HandlerSpec]:
    async def set_maintenance_mode(ctx: CommandContext) -> dict[str, Any]:
        if "enabled" not in ctx.command.payload:
            raise CommandFailed(INVALID_COMMAND, "field 'payload.enabled' is missing")
        enabled = parse_enabled(ctx.command.payload["enabled"])
        ctx.progress(
            "maintenance",
            "Switching maintenance mode on: deploy, start, restart and update are refused until "
            "it is switched off; the heartbeat status becomes maintenance"
            if enabled
            else "Switching maintenance mode off: workload commands are accepted again",
        )
        await modes.set(maintenance=enabled)
        log.info("Maintenance mode {state}", state="on" if enabled else "off")
        return {"maintenance_mode": enabled}

    async def drain_node(ctx: CommandContext) -> dict[str, Any]:
        ctx.progress("drain", "Draining: new deploy, start and restart commands are refused; "
                              "running workloads keep running")
        await modes.set(draining=True)
        log.info("Node draining: new deploys are refused")
        return {"draining": True}

    async def resume_node(ctx: CommandContext) -> dict[str, Any]:
        ctx.progress("resume", "Resuming: new workloads are accepted again")
        await modes.set(draining=False)
        log.info("Node resumed")
        return {"draining": False}

    async def sync_node_profile(ctx: CommandContext) -> dict[str, Any]:
        payload = ctx.command.payload
        profile = payload.get("profile", payload) if isinstance(payload.get("profile"), dict) else payload
        if not isinstance(profile, dict) or not profile:
            raise CommandFailed(INVALID_COMMAND, "the payload holds no profile object")
        for key in ("id", "name"):
            if key in profile and profile[key] is not None and not isinstance(profile[key], str):
                raise CommandFailed(INVALID_COMMAND, f"field 'profile.{key}' must be a string")
        await modes.set(profile=profile)
        return {"profile_id": str(profile.get("id") or ""), "profile_name": str(profile.get("name") or "")}

    async def refresh(ctx: CommandContext) -> dict[str, Any]:
        ctx.progress("collect", "Collecting a fresh inventory (host, disks, GPUs, engine)")
        sent = await refresh_inventory()
        if not sent:
            raise CommandFailed(
                "inventory_unavailable",
                "The inventory could not be collected or sent; see the agent's log on the node.",
            )
        return {"inventory_sent": True}

    async def collect(ctx: CommandContext) -> dict[str, Any]:
        ctx.progress("collect", "Collecting diagnostics (agent, session, commands, GPUs, engine)")
        return await diagnostics()

    async def host_op(ctx: CommandContext) -> dict[str, Any]:
        raise CommandFailed(
            POLICY_VIOLATION,
            "host_op is refused: this agent defines no host operations, so none can be run remotely.",
        )

    async def check_system_updates(ctx: CommandContext) -> dict[str, Any]:
        if check_updates is None:
            raise CommandFailed("unsupported", "Checking for system updates is not available here.")
        ctx.progress("check", "Listing pending package and firmware updates")
        return await check_updates()

    async def apply_system_updates(ctx: CommandContext) -> dict[str, Any]:
        raise CommandFailed(
            POLICY_VIOLATION,
            "apply_system_updates is refused: llmport-agent does not upgrade the host's packages or "
            "firmware remotely. The node's operator applies them (check_system_updates lists them).",
        )

    node = dict(lane="node", idempotent=True)
    return {
        "set_maintenance_mode": HandlerSpec(set_maintenance_mode, deadline=30, **node),  # type: ignore[arg-type]
        "drain_node": HandlerSpec(drain_node, deadline=30, **node),  # type: ignore[arg-type]
        "resume_node": HandlerSpec(resume_node, deadline=30, **node),  # type: ignore[arg-type]
        "sync_node_profile": HandlerSpec(sync_node_profile, deadline=30, **node),  # type: ignore[arg-type]
        "refresh_inventory": HandlerSpec(refresh, lane="read", idempotent=True, deadline=60),
        "collect_diagnostics": HandlerSpec(collect, lane="read", idempotent=True, deadline=60,
                                           keep_result=False),
        "host_op": HandlerSpec(host_op, lane="read", idempotent=True, deadline=10),
        "check_system_updates": HandlerSpec(check_system_updates, lane="read", idempotent=True,
                                            deadline=300),
        "apply_system_updates": HandlerSpec(apply_system_updates, lane="read", idempotent=True,
                                            deadline=10),
    }

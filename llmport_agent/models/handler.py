"""
The C{sync_model} command (protocol 4: admin API only, payload C{{model_sync: {...}}}).

Lane choice: C{read}. The pipeline's lanes exist to order commands that touch the same
state; a model sync needs no such ordering from the pipeline because L{ModelSyncer}
serialises work per model directory itself (and shares one operation between identical
requests, e.g. a C{sync_model} and a deploy's C{sync_model} phase for the same model).
C{node} would make a multi-hour copy block maintenance/drain/profile commands, and
C{runtime} has no runtime id to key on. C{read} lets it run beside everything else.

This module imports no part of the syncer: the agent builds its table of commands at start
with a syncer built at the first C{sync_model} (L{llmport_agent.core.later.Later}).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmport_agent.commands.base import INVALID_COMMAND, CommandContext, CommandFailed, HandlerSpec

if TYPE_CHECKING:
    from llmport_agent.models.syncer import ModelSyncer

#: Hundreds of GB at the speed of a site's link: the pipeline deadline is generous. The sync
#: resumes from its partial files when it is run again after a cancellation or a restart.
DEFAULT_DEADLINE = 12 * 3600.0


def sync_model_handler_spec(
    syncer: ModelSyncer, *, deadline: float = DEFAULT_DEADLINE
) -> HandlerSpec:
    """
    The L{HandlerSpec} of C{sync_model}: idempotent (a re-run resumes and reuses what is
    there), not blocked by maintenance or draining (staging a model changes no workload).
    The result is L{ModelSyncer.sync}'s summary plus the fields the backend reads to mark the
    model READY on this node (protocol 10.4: C{root_path}, C{revision}, C{manifest_sha256},
    C{total_size}, ...).
    """

    async def handle(ctx: CommandContext) -> dict[str, Any]:
        payload = ctx.command.payload
        model_sync = payload.get("model_sync")
        if model_sync is None and "model_dir_name" in payload:
            model_sync = payload  # tolerate the manifest sent as the payload itself
        if not isinstance(model_sync, Mapping):
            raise CommandFailed(
                INVALID_COMMAND,
                "payload.model_sync must be an object (a model manifest, or at least model_id).",
            )
        revision = model_sync.get("revision") or payload.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise CommandFailed(INVALID_COMMAND, "revision must be a string (a ref name or a commit).")
        return await syncer.sync(model_sync, ctx.progress, report=True, revision=revision or None)

    return HandlerSpec(
        handler=handle,
        lane="read",
        idempotent=True,
        deadline=deadline,
        blocked_by_maintenance=False,
        blocked_by_draining=False,
        keep_result=True,
    )

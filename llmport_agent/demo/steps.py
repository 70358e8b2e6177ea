"""
What the demos share: how a demo says a line and how long one step may take. L{run} (the
single-node demo) and L{ray_env} (the two-node Ray demo) both import from here, never each other.
"""

from __future__ import annotations

from collections.abc import Callable

#: How long one demo step (enrolled, first heartbeat, a command's result) may take.
STEP_TIMEOUT = 10.0

#: How a demo tells its story: one line at a time.
Say = Callable[[str], None]


def say(text: str) -> None:
    """Print one line of the story at once (the demo's default L{Say})."""
    print(text, flush=True)

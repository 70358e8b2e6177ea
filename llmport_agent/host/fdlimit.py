"""
The open-files limit: systemd (and most shells) start a process with a soft limit of 1,024
descriptors, which a busy agent (Docker streams, log followers, HTTP connections, the journal)
can reach. At start the soft limit is raised to the hard one (capped at L{WANTED}); the unit
sets C{LimitNOFILE=} as well.
"""

from __future__ import annotations

import resource

from twisted.logger import Logger

__all__ = ["WANTED", "raise_open_files_limit"]

WANTED = 65536

_log = Logger()


def raise_open_files_limit(wanted: int = WANTED, rlimit: object = resource) -> int:
    """Raise the soft C{RLIMIT_NOFILE} towards C{wanted} (never above the hard limit); the new soft limit."""
    getrlimit = rlimit.getrlimit  # type: ignore[attr-defined]
    setrlimit = rlimit.setrlimit  # type: ignore[attr-defined]
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            _log.warn("Could not raise the open-files limit from {soft} to {target} ({error})",
                      soft=soft, target=target, error=str(e))
    return int(soft)

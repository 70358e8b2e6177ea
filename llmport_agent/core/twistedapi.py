"""
The one place that uses Twisted's private names.

Twisted has no public way to make an C{HTTPConnectionPool}'s connection factory quiet (its
class is the pool's private C{_factory}); a pool that logs "Starting factory" for every
connection would feed the log shipper its own noise. Nor to forget the signal twistd
re-raises at exit (C{reactor._exitSignal}), so that a clean drain after SIGTERM exits 0.
They stay here behind public names,
so a Twisted upgrade that changes it breaks one file. C{tests/archcheck.py} lists this
module as the allowlisted adapter for Twisted and reports its reaches apart from the
package's count.
"""

from __future__ import annotations

from typing import Any


def quiet_pool_factory(pool: Any) -> None:
    """Stop C{pool}'s connections from logging "Starting factory" / "Stopping factory"."""
    pool._factory.noisy = False


def forget_exit_signal(reactor: Any, signals: tuple[int, ...]) -> None:
    """If twistd would re-raise one of C{signals} at exit, make it exit normally instead."""
    if getattr(reactor, "_exitSignal", None) in signals:
        reactor._exitSignal = None


__all__ = ["forget_exit_signal", "quiet_pool_factory"]

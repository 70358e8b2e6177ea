"""
The one place that uses Twisted's private names.

Twisted has no public way to make an C{HTTPConnectionPool}'s connection factory quiet (its
class is the pool's private C{_factory}); a pool that logs "Starting factory" for every
connection would feed the log shipper its own noise. It stays here behind a public name,
so a Twisted upgrade that changes it breaks one file. C{tests/archcheck.py} lists this
module as the allowlisted adapter for Twisted and reports its reaches apart from the
package's count.
"""

from __future__ import annotations

from typing import Any


def quiet_pool_factory(pool: Any) -> None:
    """Stop C{pool}'s connections from logging "Starting factory" / "Stopping factory"."""
    pool._factory.noisy = False


__all__ = ["quiet_pool_factory"]

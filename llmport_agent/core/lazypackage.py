"""
A package whose C{__init__} runs at the first read of one of its own names (issue 27: import
what the agent uses, when it uses it).

L{defer_package_init} registers a package so that its submodules import without running the
package's own C{__init__} first. Autobahn's C{autobahn.twisted} package imports its WAMP
modules (and with them cryptography's backends), which the WebSocket client never uses: about
3 ms of every start with the garbage collector held off (L{llmport_agent.core.startgc}), some
15 ms with it running (L{llmport_agent.session}). For single modules imported at their first
use, see L{llmport_agent.core.lazyimport}.

Import time and the reactor thread: C{__init__} runs in whichever thread first reads a name
only it defines, without the import lock; two threads racing for that first read could see
the second one's read fail while the first runs it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

__all__ = ["defer_package_init"]


def defer_package_init(name: str) -> bool:
    """
    Make the package C{name} importable without running its C{__init__} now: its submodules
    (C{import name.sub}) import as usual, and C{__init__} runs, once, at the first read of a
    name that is not there yet (C{from name import X}, C{name.X}), as if it had run at first.
    Nothing is done when the package is already imported or not found. Returns whether the
    package was registered so.
    """
    if name in sys.modules:
        return False
    parent, _, child = name.rpartition(".")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def init_now(attr: str) -> Any:
        # Deleted first: a read of a missing name while __init__ runs is a plain AttributeError.
        if module.__dict__.pop("__getattr__", None) is not None:
            loader.exec_module(module)
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    module.__getattr__ = init_now  # type: ignore[method-assign]
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], child, module)
    return True

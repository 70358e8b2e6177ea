"""
A module imported at its first use (issue 27: import what the agent uses, when it uses it).

C{docker = LazyModule("docker")} binds a name that imports docker-py (with requests, about
7 MiB and 0.1 s) at the first attribute read: C{docker.errors.NotFound} in an C{except} clause
is read only when an exception reaches it, and the functions that run docker-py take a client,
which exists only once docker-py is imported. Type checkers see the real module: import it
under C{TYPE_CHECKING} and bind the lazy one otherwise.

L{defer_package_init} registers a package so that its submodules import without running the
package's own C{__init__} first; that runs at the first read of a name only C{__init__}
defines. Autobahn's C{autobahn.twisted} package imports its WAMP modules (and with them
cryptography's backends), which the WebSocket client never uses: about 15 ms of every start.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module C{name}; imports it at the first attribute read."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def module(self) -> ModuleType:
        """The module itself (imported now if it was not)."""
        mod = sys.modules.get(self._name)
        return mod if mod is not None else importlib.import_module(self._name)

    def loaded(self) -> bool:
        """Whether the module is imported (by anyone)."""
        return self._name in sys.modules

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.module(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (imported)' if self.loaded() else ''}>"


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

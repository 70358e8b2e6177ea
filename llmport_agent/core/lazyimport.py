"""
A module imported at its first use (issue 27: import what the agent uses, when it uses it).

C{docker = LazyModule("docker")} binds a name that imports docker-py (with requests, about
7 MiB and 0.1 s) at the first attribute read: C{docker.errors.NotFound} in an C{except} clause
is read only when an exception reaches it, and the functions that run docker-py take a client,
which exists only once docker-py is imported. Type checkers see the real module: import it
under C{TYPE_CHECKING} and bind the lazy one otherwise.
"""

from __future__ import annotations

import importlib
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

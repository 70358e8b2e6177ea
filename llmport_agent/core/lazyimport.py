"""
A module imported at its first use (issue 27: import what the agent uses, when it uses it).

C{docker = LazyModule("docker")} binds a name that imports docker-py (with requests, about
7 MiB and 0.1 s) at the first attribute read: C{docker.errors.NotFound} in an C{except} clause
is read only when an exception reaches it, and the functions that run docker-py take a client,
which exists only once docker-py is imported. Type checkers see the real module: import it
under C{TYPE_CHECKING} and bind the lazy one otherwise.

C{Later(build)} is the same for a component of the agent: built (and its module imported) at
its first use, e.g. the Ray manager at the first Ray command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Generic, TypeVar


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


T = TypeVar("T")


class Later(Generic[T]):
    """
    A component built at its first use: C{get()} builds it (once) with C{build}, which imports
    its module then. L{calls} stands for it where a method is wanted before any use (a command
    handler table): C{later.calls().deploy} is a function that builds the component when it is
    first called and calls its C{deploy}. Reactor thread only (no lock).
    """

    __slots__ = ("_build", "_value", "_built")

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._value: T | None = None
        self._built = False

    def get(self) -> T:
        """The component, built now if it was not."""
        if not self._built:
            self._value = self._build()
            self._built = True
        return self._value  # type: ignore[return-value]

    @property
    def built(self) -> bool:
        """Whether L{get} has built it."""
        return self._built

    def if_built(self) -> T | None:
        """The component if it is built, else C{None} (builds nothing)."""
        return self._value if self._built else None

    def calls(self) -> Any:
        """An object whose attributes are the component's methods, each built at its first call."""
        return _Calls(self)


class _Calls:
    __slots__ = ("_later",)

    def __init__(self, later: Later[Any]) -> None:
        object.__setattr__(self, "_later", later)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        later = self._later

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(later.get(), name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        return call

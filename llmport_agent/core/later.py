"""
A component of the agent built at its first use (issue 27: import what the agent uses, when it
uses it): C{Later(build)} builds it, and imports its module, at the first L{Later.get}, e.g.
the Ray manager at the first Ray command. See also L{llmport_agent.core.lazyimport} (a module
imported at its first use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Later"]


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
    _later: Later[Any]

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

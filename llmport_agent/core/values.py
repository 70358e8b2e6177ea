"""
The agent's attrs class decorators: L{frozen} and L{define} are attrs' own, except that
C{__repr__}, C{__eq__}, C{__ne__} and C{__hash__} are shared functions instead of methods that
attrs writes as source and compiles for each class (issue 27: start to connected).

Why: attrs compiles those four for every class as it is defined: on this machine about
0.2 ms for a class of four fields and 0.4 ms for one of ten, half or more of what the
class costs, and the agent defines some fifty classes before it first connects
(C{BENCHMARKS.md}: "Start to connected (sixth pass)"). The shared ones cost a closure each.

What they do is what attrs' generated ones do (C{tests/test_values.py} holds them side by side
with attrs' on the same classes):
 - C{__repr__}: C{Name(a=1, b='x')}, the fields whose C{repr} is not C{False}, a C{repr=}
   callable's result in place of C{repr()}, C{...} for an instance already being printed on
   this thread (a cycle); a C{repr=False} field (a secret) never appears;
 - C{__eq__}: C{NotImplemented} for another class, else each field with C{eq} (through its
   C{eq=} key function, if any) compared with C{==}, in order;
 - C{__hash__}: frozen and compared: the hash of the class and the hashed fields (C{hash=True},
   or C{eq} where C{hash} is not given); mutable and compared: C{None} (unhashable); not
   compared: inherited;
 - a method the class body writes itself is kept (attrs' C{auto_detect}).
Anything else goes to attrs unchanged, the class then attrs' own entirely: ordering, C{hash=},
C{unsafe_hash=}, C{cache_hash=}, C{repr_ns=}, C{str=}, C{auto_detect=}, C{auto_exc=}, and
exception classes (attrs' C{auto_exc}: compared and hashed by identity). Type checkers see
attrs' decorators themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

__all__ = ["define", "frozen"]

#: Options this module leaves to attrs (the class is then attrs' own entirely).
_ATTRS_ONLY = ("order", "hash", "unsafe_hash", "cache_hash", "repr_ns", "str", "auto_detect", "auto_exc")

#: The ids of the instances being printed on this thread (a cycle prints C{...}).
_printing = threading.local()


def _repr_of(cls: type) -> Callable[[Any], str]:
    shown = tuple(
        (a.name, None if a.repr is True else a.repr, a.init) for a in attrs.fields(cls) if a.repr is not False
    )
    nothing = attrs.NOTHING

    def __repr__(self: Any) -> str:
        seen: set[int] | None = getattr(_printing, "ids", None)
        if seen is None:
            seen = _printing.ids = set()
        if id(self) in seen:
            return "..."
        seen.add(id(self))
        try:
            parts = []
            for name, show, init in shown:
                value = getattr(self, name) if init else getattr(self, name, nothing)
                parts.append(f"{name}={value!r}" if show is None else f"{name}={show(value)}")
            return f"{self.__class__.__qualname__.rsplit('>.', 1)[-1]}({', '.join(parts)})"
        finally:
            seen.discard(id(self))

    __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
    return __repr__


def _eq_of(cls: type) -> Callable[[Any, Any], Any]:
    compared = tuple((a.name, a.eq_key) for a in attrs.fields(cls) if a.eq)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        for name, key in compared:
            if key is None:
                if not getattr(self, name) == getattr(other, name):
                    return False
            elif not key(getattr(self, name)) == key(getattr(other, name)):
                return False
        return True

    __eq__.__qualname__ = f"{cls.__qualname__}.__eq__"
    return __eq__


def _ne(self: Any, other: Any) -> Any:
    result = self.__eq__(other)
    if result is NotImplemented:
        return NotImplemented
    return not result


def _hash_of(cls: type) -> Callable[[Any], int]:
    hashed = tuple(
        (a.name, a.eq_key) for a in attrs.fields(cls) if a.hash is True or (a.hash is None and a.eq is True)
    )

    def __hash__(self: Any) -> int:
        return hash((cls, *(getattr(self, n) if k is None else k(getattr(self, n)) for n, k in hashed)))

    __hash__.__qualname__ = f"{cls.__qualname__}.__hash__"
    return __hash__


def _wrap(build: Callable[..., Any], name: str, is_frozen: bool) -> Callable[..., Any]:
    def decorate(maybe_cls: type | None = None, **kw: Any) -> Any:
        if any(k in kw for k in _ATTRS_ONLY):
            return build(maybe_cls, **kw)

        def apply(cls: type) -> type:
            if issubclass(cls, BaseException):
                # attrs' auto_exc: an exception compares and hashes by identity.
                return build(cls, **kw)  # type: ignore[no-any-return]
            body = cls.__dict__
            # attrs' auto_detect: a method the body writes is the class's own.
            want_repr = kw.get("repr")
            want_repr = "__repr__" not in body if want_repr is None else want_repr
            want_eq = kw.get("eq")
            want_eq = not ("__eq__" in body or "__ne__" in body) if want_eq is None else want_eq
            own_hash = "__hash__" in body
            made: type = build(cls, **{**kw, "repr": False, "eq": False})
            if want_repr:
                made.__repr__ = _repr_of(made)  # type: ignore[method-assign,assignment]
            if want_eq:
                made.__eq__ = _eq_of(made)  # type: ignore[method-assign,assignment]
                made.__ne__ = _ne  # type: ignore[method-assign,assignment]
                if not own_hash:
                    hashable = is_frozen or bool(kw.get("frozen"))
                    made.__hash__ = _hash_of(made) if hashable else None  # type: ignore[method-assign,assignment]
            return made

        return apply if maybe_cls is None else apply(maybe_cls)

    decorate.__name__ = decorate.__qualname__ = name
    decorate.__doc__ = f"attrs' C{{{name}}}, with shared repr/eq/hash (L{{llmport_agent.core.values}})."
    return decorate


if TYPE_CHECKING:
    from attrs import define, frozen
else:
    frozen = _wrap(attrs.frozen, "frozen", True)
    define = _wrap(attrs.define, "define", False)

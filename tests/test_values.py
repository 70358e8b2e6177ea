"""
L{llmport_agent.core.values}: attrs' decorators with shared repr/eq/hash. Each behaviour is held
side by side with attrs' own generated methods on the same class shape, and the agent's
modules are held to the decorators (a class that goes back to attrs' own costs its compile at
import again: issue 27).
"""

from __future__ import annotations

import ast
import math
import os
from typing import Any

import attrs
from attrs import field
from twisted.trial.unittest import SynchronousTestCase

import llmport_agent
from llmport_agent.core import values


def _twins(decorator: str, body: dict[str, Any], **kw: Any) -> tuple[type, type]:
    """
    One class shape made by attrs' C{decorator} and by ours, both named C{Shape}: C{body} maps
    a field to its default (C{None}: none), C{f_<name>} to a function that makes its C{field()},
    and C{__<name>__} to a method of the body.
    """
    made = []
    for module in (attrs, values):
        ns: dict[str, Any] = {"__annotations__": {}, "__module__": __name__, "__qualname__": "Shape"}
        for name, value in body.items():
            if name.startswith("f_"):
                ns["__annotations__"][name[2:]] = "Any"
                ns[name[2:]] = value()
            elif name.startswith("__"):
                ns[name] = value
            else:
                ns["__annotations__"][name] = "Any"
                if value is not None:
                    ns[name] = value
        cls = type("Shape", (), ns)
        made.append(getattr(module, decorator)(**kw)(cls) if kw else getattr(module, decorator)(cls))
    return made[0], made[1]


class ReprTests(SynchronousTestCase):
    def test_the_same_text_as_attrs(self) -> None:
        for deco in ("frozen", "define"):
            theirs, ours = _twins(deco, {"a": None, "b": "x", "c": ()})
            self.assertEqual(repr(ours(1, "y", (2, "z"))), repr(theirs(1, "y", (2, "z"))))
            self.assertEqual(repr(ours(1, "y", (2, "z"))), "Shape(a=1, b='y', c=(2, 'z'))")

    def test_a_field_with_repr_false_never_appears(self) -> None:
        theirs, ours = _twins("frozen", {"user": None, "f_token": lambda: field(repr=False)})
        text = repr(ours("u", "s3cr3t-token"))
        self.assertNotIn("s3cr3t", text)
        self.assertEqual(text, repr(theirs("u", "s3cr3t-token")))
        self.assertEqual(text, "Shape(user='u')")

    def test_a_repr_callable_is_used(self) -> None:
        theirs, ours = _twins("frozen", {"f_key": lambda: field(repr=lambda v: "<" + str(len(v)) + " bytes>")})
        self.assertEqual(repr(ours(b"abcd")), "Shape(key=<4 bytes>)")
        self.assertEqual(repr(ours(b"abcd")), repr(theirs(b"abcd")))

    def test_an_unset_init_false_field_prints_as_attrs_does(self) -> None:
        theirs, ours = _twins("define", {"a": None, "f_later": lambda: field(init=False)})
        self.assertEqual(repr(ours(1)), repr(theirs(1)))

    def test_a_cycle_prints_dots(self) -> None:
        theirs, ours = _twins("define", {"items": None})
        for cls in (theirs, ours):
            x = cls([])
            x.items.append(x)
            self.assertEqual(repr(x), "Shape(items=[...])")
        # And the next print on the thread is whole again.
        self.assertEqual(repr(ours([1])), "Shape(items=[1])")

    def test_an_exception_inside_leaves_no_trace(self) -> None:
        class Boom:
            def __repr__(self) -> str:
                raise RuntimeError("boom")

        _, ours = _twins("frozen", {"a": None})
        x = ours(Boom())
        self.assertRaises(RuntimeError, repr, x)
        # The instance is not left marked as being printed.
        self.assertRaises(RuntimeError, repr, x)

    def test_a_body_repr_is_kept_and_repr_false_leaves_objects_own(self) -> None:
        _, ours = _twins("frozen", {"a": None, "__repr__": lambda self: "mine"})
        self.assertEqual(repr(ours(1)), "mine")
        _, plain = _twins("frozen", {"a": None}, repr=False)
        self.assertTrue(repr(plain(1)).startswith("<"))


class EqHashTests(SynchronousTestCase):
    def test_equal_values_are_equal_and_hash_alike(self) -> None:
        _, ours = _twins("frozen", {"a": None, "b": None})
        self.assertEqual(ours(1, "x"), ours(1, "x"))
        self.assertEqual(hash(ours(1, "x")), hash(ours(1, "x")))
        self.assertNotEqual(ours(1, "x"), ours(1, "y"))
        self.assertNotEqual(ours(1, "x"), ours(2, "x"))
        self.assertFalse(ours(1, "x") != ours(1, "x"))
        self.assertTrue(ours(1, "x") != ours(2, "x"))
        self.assertEqual(len({ours(1, "x"), ours(1, "x"), ours(2, "x")}), 2)

    def test_another_class_is_not_implemented(self) -> None:
        theirs, ours = _twins("frozen", {"a": None})

        @values.frozen
        class Sub(ours):  # type: ignore[valid-type,misc]
            pass

        self.assertIs(ours(1).__eq__(theirs(1)), NotImplemented)
        self.assertIs(ours(1).__ne__(theirs(1)), NotImplemented)
        self.assertNotEqual(ours(1), Sub(1))
        self.assertNotEqual(ours(1), (1,))

    def test_fields_compare_with_eq_as_attrs_does(self) -> None:
        # attrs compares field by field with ==: nan is not equal to itself, even the same object.
        theirs, ours = _twins("frozen", {"a": None})
        nan = math.nan
        self.assertEqual(ours(nan) == ours(nan), theirs(nan) == theirs(nan))
        self.assertFalse(ours(nan) == ours(nan))

    def test_eq_false_fields_are_left_out_of_eq_and_hash(self) -> None:
        _, ours = _twins("frozen", {"a": None, "f_raw": lambda: field(eq=False)})
        self.assertEqual(ours(1, {"x": 1}), ours(1, {"y": 2}))
        self.assertEqual(hash(ours(1, [1])), hash(ours(1, [2])))  # an unhashable raw is not hashed

    def test_hash_false_fields_are_compared_but_not_hashed(self) -> None:
        _, ours = _twins("frozen", {"a": None, "f_b": lambda: field(hash=False)})
        self.assertNotEqual(ours(1, 2), ours(1, 3))
        self.assertEqual(hash(ours(1, [2])), hash(ours(1, [3])))

    def test_an_eq_key_is_used_in_eq_and_hash(self) -> None:
        theirs, ours = _twins("frozen", {"f_name": lambda: field(eq=str.lower)})
        self.assertEqual(ours("GPU"), ours("gpu"))
        self.assertEqual(hash(ours("GPU")), hash(ours("gpu")))
        self.assertEqual(theirs("GPU") == theirs("gpu"), ours("GPU") == ours("gpu"))
        self.assertNotEqual(ours("GPU"), ours("cpu"))

    def test_the_hash_follows_the_values(self) -> None:
        _, ours = _twins("frozen", {"a": None, "b": None})
        hashes = {hash(ours(i, j)) for i in range(20) for j in range(20)}
        self.assertGreater(len(hashes), 390)

    def test_a_mutable_value_is_unhashable_as_with_attrs(self) -> None:
        theirs, ours = _twins("define", {"a": None})
        self.assertIsNone(theirs.__hash__)
        self.assertIsNone(ours.__hash__)
        self.assertRaises(TypeError, hash, ours(1))
        self.assertEqual(ours(1), ours(1))

    def test_define_frozen_is_hashable(self) -> None:
        _, ours = _twins("define", {"a": None}, frozen=True)
        self.assertEqual(hash(ours(1)), hash(ours(1)))
        self.assertRaises(attrs.exceptions.FrozenInstanceError, setattr, ours(1), "a", 2)

    def test_eq_false_is_identity(self) -> None:
        for deco in ("frozen", "define"):
            _, ours = _twins(deco, {"a": None}, eq=False)
            x = ours(1)
            self.assertNotEqual(x, ours(1))
            self.assertEqual(x, x)
            self.assertEqual(hash(x), object.__hash__(x))

    def test_a_body_eq_and_hash_are_kept(self) -> None:
        def eq(self: Any, other: Any) -> bool:
            return True

        _, ours = _twins("frozen", {"a": None, "__eq__": eq, "__hash__": lambda self: 7})
        self.assertEqual(ours(1), ours(2))
        self.assertEqual(hash(ours(1)), 7)

    def test_ordering_goes_to_attrs(self) -> None:
        _, ours = _twins("frozen", {"a": None}, order=True)
        self.assertLess(ours(1), ours(2))
        self.assertEqual(sorted([ours(3), ours(1)]), [ours(1), ours(3)])

    def test_exceptions_and_the_other_options_are_attrs_own(self) -> None:
        @values.define
        class Failed(Exception):
            why: str

        a, b = Failed("x"), Failed("x")
        self.assertNotEqual(a, b)  # attrs' auto_exc: identity
        self.assertEqual(hash(a), object.__hash__(a))
        _, shown = _twins("define", {"a": None}, str=True)
        self.assertEqual(str(shown(1)), "Shape(a=1)")
        _, plain = _twins("frozen", {"a": None, "__repr__": lambda self: "mine"}, auto_detect=False)
        self.assertEqual(repr(plain(1)), "Shape(a=1)")  # auto_detect off: attrs' repr wins

    def test_values_stay_attrs_classes(self) -> None:
        _, ours = _twins("frozen", {"a": None, "b": 2})
        x = ours(1)
        self.assertTrue(attrs.has(ours))
        self.assertEqual(attrs.asdict(x), {"a": 1, "b": 2})
        self.assertEqual(attrs.evolve(x, b=3), ours(1, 3))
        self.assertEqual(ours.__slots__, ("a", "b", "__weakref__"))


class TheAgentUsesThemTests(SynchronousTestCase):
    def test_no_module_decorates_with_attrs_own(self) -> None:
        """Every attrs class of the agent takes L{values.frozen} or L{values.define}."""
        root = os.path.dirname(llmport_agent.__file__)
        offenders = []
        for dirpath, _, files in os.walk(root):
            for name in files:
                if not name.endswith(".py") or name == "values.py":
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                makers = ("define", "frozen", "mutable", "s", "attrs", "dataclass")
                names = {"attrs", "attr"}  # and what `import attrs as x` binds
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names.update(a.asname for a in node.names if a.name in ("attrs", "attr") and a.asname)
                for node in ast.walk(tree):
                    if isinstance(node, ast.ImportFrom) and node.module in ("attrs", "attr"):
                        bad = [a.name for a in node.names if a.name in makers]
                        if bad:
                            offenders.append(f"{os.path.relpath(path, root)}:{node.lineno} imports {bad}")
                    elif (
                        isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Name)
                        and node.value.id in names
                        and node.attr in makers
                    ):
                        offenders.append(f"{os.path.relpath(path, root)}:{node.lineno} uses {node.value.id}.{node.attr}")
        self.assertEqual(offenders, [])

    def test_the_agents_values_carry_the_shared_methods(self) -> None:
        from llmport_agent.core.config import Setting
        from llmport_agent.inventory.gpu import GPUSnapshot
        from llmport_agent.workloads.settings import WorkloadSettings

        for cls in (Setting, GPUSnapshot, WorkloadSettings):
            for method in ("__repr__", "__eq__", "__hash__"):
                code = getattr(cls, method).__code__
                self.assertEqual(os.path.basename(code.co_filename), "values.py", f"{cls.__name__}.{method}")

"""Partition rules: which nodes of a traced model make up which named op of its layer.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from nanosched.errors import ConfigError
from nanosched.models.ops import RESOURCE_CLASSES

MARK_KEY = "nanosched_op"
_ROOT = re.compile(r"^L(\[[^\]]*\])+\.?")


@dataclass(frozen=True)
class SplitModule:
    """Nodes inside modules of class `target` (or whose path matches the glob `target`)."""

    target: type[torch.nn.Module] | str
    op: str
    resource: str | None = None

    def matches(self, node: fx.Node) -> bool:
        for path, cls in module_stack(node):
            if isinstance(self.target, str):
                if fnmatch.fnmatchcase(path, self.target):
                    return True
            elif isinstance(cls, type) and issubclass(cls, self.target):
                return True
        return False


@dataclass(frozen=True)
class SplitFunc:
    """Nodes calling `target` (a callable) or inside a Python function named `target`; with
    `inside`, only nodes within a module of that class (or whose path matches that glob)."""

    target: Callable[..., Any] | str
    op: str
    resource: str | None = None
    inside: type[torch.nn.Module] | str | None = None

    def matches(self, node: fx.Node) -> bool:
        if self.inside is not None and not SplitModule(self.inside, self.op).matches(node):
            return False
        if isinstance(self.target, str):
            return node.op == "call_function" and target_name(node.target) == self.target or \
                node.op == "call_method" and node.target == self.target or \
                self.target in stack_functions(node)
        return node.op == "call_function" and same_callable(node.target, self.target)


Rule = SplitModule | SplitFunc


@contextmanager
def mark(op: str) -> Iterator[None]:
    """Every node traced inside this block belongs to op `op` (tags the nodes' metadata)."""
    with torch.fx.traceback.annotate({MARK_KEY: op}):
        yield


@dataclass(frozen=True)
class Rules:
    """The partition rules of one model family (see the module docstring)."""

    rules: tuple[Rule, ...]
    first_op: str | None = None  # the op a layer starts at (default: the first rule's op)

    def __post_init__(self) -> None:
        if not self.rules:
            raise ConfigError("partition rules: give at least one SplitModule or SplitFunc")
        for r in self.rules:
            if not isinstance(r, (SplitModule, SplitFunc)):
                raise ConfigError(f"partition rule {r!r} is not a SplitModule or SplitFunc")
            if r.resource is not None and r.resource not in RESOURCE_CLASSES:
                raise ConfigError(f"rule for op {r.op!r}: resource {r.resource!r} is not one of "
                                  f"{', '.join(RESOURCE_CLASSES)}")
            if r.op in ("embed", "head"):
                raise ConfigError(f"op name {r.op!r} is reserved for the prologue / epilogue")
        if self.first_op is not None and self.first_op not in {r.op for r in self.rules}:
            raise ConfigError(f"first_op {self.first_op!r} is not the op of any rule")

    @property
    def start(self) -> str:
        return self.first_op or self.rules[0].op

    def label(self, node: fx.Node) -> str | None:
        """The op of `node`, or None when no rule (or mark) claims it."""
        custom = node.meta.get("custom") or {}
        if MARK_KEY in custom:
            return str(custom[MARK_KEY])
        for r in self.rules:
            if r.matches(node):
                return r.op
        return None

    def resource_of(self, op: str) -> str | None:
        """The resource class a rule gives op `op` (None: inferred from what it calls)."""
        return next((r.resource for r in self.rules if r.op == op and r.resource), None)

    def extended(self, extra: Sequence[Rule]) -> Rules:
        """These rules, then `extra` (lower priority)."""
        return Rules(self.rules + tuple(extra), self.first_op or self.rules[0].op)


def module_stack(node: fx.Node) -> list[tuple[str, Any]]:
    """(dotted path from the traced root, class) of the modules a node was computed in,
    outermost first."""
    out = []
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        out.append((_strip_root(path), cls))
    return out


def _strip_root(path: str) -> str:
    # Dynamo writes paths from the traced root: L['self'].model.layers.0, L['args'][0].lm_head
    return _ROOT.sub("", path)


def stack_functions(node: fx.Node) -> list[str]:
    """The Python functions on the node's stack trace (innermost last)."""
    trace = node.meta.get("stack_trace") or ""
    return [line.rsplit(" in ", 1)[-1].strip() for line in trace.splitlines()
            if line.strip().startswith("File ") and " in " in line]


def target_name(target: Any) -> str:
    """A readable name of a node's target (`linear`, `silu`, `nanosched.kv_append`, ...)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split("::", 1)[-1].split(".", 1)[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::", 1)[-1]
    return getattr(target, "__name__", str(target))


def same_callable(a: Any, b: Any) -> bool:
    """Whether a node target `a` is the callable `b` (an op packet matches its overloads)."""
    if a is b:
        return True
    if isinstance(a, torch._ops.OpOverload) and isinstance(b, torch._ops.OpOverloadPacket):
        return a.overloadpacket is b
    if isinstance(b, torch._ops.OpOverload) and isinstance(a, torch._ops.OpOverloadPacket):
        return b.overloadpacket is a
    return False

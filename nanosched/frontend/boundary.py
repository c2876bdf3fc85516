"""What each op of the partition reads from outside itself, and the tensors that cross ops.

An op (a `Group`) reads four kinds of outside values:

- tensors another op computed (`Value`s: they live in preallocated buffers, sliced by rows);
- graph inputs: the token inputs (`input_ids`, `position_ids`: rows of the batch) and the
  constants (parameters, buffers);
- symbolic integers (sizes): functions of the token count, recomputed for each range;
- views of any of these (`x.view(...)`, `w.t()`, `getitem` of a split): recomputed inside the
  op ("rematerialised"), so a view never crosses ops and every crossing tensor is one an op
  computes, which it can write straight into its buffer.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from nanosched.errors import ConfigError
from nanosched.frontend.partition import Group, Partition, example, is_size, is_view


@dataclass(frozen=True)
class Value:
    """A tensor computed by one op and read (or written) by later ones."""

    name: str
    dtype: torch.dtype
    sizes: tuple[int, ...]  # the token dimension's entry is rows per token
    token_dim: int
    perm: tuple[int, ...]  # physical dimension order, token dimension first

    @property
    def rows_per_token(self) -> int:
        return self.sizes[self.token_dim]

    def signature(self) -> tuple:
        """Values of equal signature may share a buffer."""
        return self.dtype, self.sizes, self.token_dim, self.perm


@dataclass
class Reads:
    """The outside values of one op, each in the order its subgraph takes them."""

    values: list[fx.Node] = field(default_factory=list)  # computed by earlier ops
    inputs: list[fx.Node] = field(default_factory=list)  # graph placeholders
    symbols: list[fx.Node] = field(default_factory=list)  # SymInt-valued nodes of other ops
    remat: list[fx.Node] = field(default_factory=list)  # views recomputed inside the op


def outside_reads(group: Group, own: set[fx.Node]) -> Reads:
    reads, seen = Reads(), set()

    def visit(a: fx.Node) -> None:
        if a in own or a in seen:
            return
        seen.add(a)
        if is_size(a):
            reads.symbols.append(a)
        elif a.op == "placeholder":
            reads.inputs.append(a)
        elif is_view(a):
            reads.remat.append(a)
            for b in a.all_input_nodes:
                visit(b)
        else:
            reads.values.append(a)

    for n in group.nodes:
        for a in n.all_input_nodes:
            visit(a)
    return reads


def crossing_values(part: Partition, reads: list[Reads], symbol: sympy.Symbol
                    ) -> dict[fx.Node, Value]:
    """Every tensor one op computes and another reads, as a `Value`."""
    out: dict[fx.Node, Value] = {}
    for i, r in enumerate(reads):
        for v in r.values:
            if v not in out:
                out[v] = crossing_value(v, symbol, f"{part.groups[part.group_of[v]].name} "
                                                   f"(read by {part.groups[i].name})")
    return out


def crossing_value(node: fx.Node, symbol: sympy.Symbol, where: str) -> Value:
    t = example(node)
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{node.name} of op {where} is a {type(t).__name__}, not a tensor: "
                          f"ops may only pass tensors to each other")
    dims = [d for d, size in enumerate(t.shape) if symbol in _expr(size).free_symbols]
    sizes = []
    for d, size in enumerate(t.shape):
        e = _expr(size)
        c = sympy.simplify(e / symbol) if d in dims else e
        if not c.is_Integer or int(c) < 1:
            raise ConfigError(f"{node.name} of op {where} has shape {tuple(t.shape)}: a tensor "
                              f"passed between ops needs one dimension of c x T tokens and "
                              f"sizes that do not otherwise depend on T")
        sizes.append(int(c))
    if len(dims) != 1:
        raise ConfigError(f"{node.name} of op {where} has shape {tuple(t.shape)}: a tensor passed "
                          f"between ops needs exactly one dimension proportional to the token "
                          f"count (it has {len(dims)})")
    token_dim = dims[0]
    big = 1_000_003  # strides at a large T: the traced order of the dimensions
    strides = [int(_expr(s).subs(symbol, big)) for s in t.stride()]
    rest = sorted((d for d in range(t.dim()) if d != token_dim), key=lambda d: -strides[d])
    return Value(node.name, t.dtype, tuple(sizes), token_dim, (token_dim, *rest))


def _expr(x: object) -> sympy.Expr:
    if isinstance(x, sympy.Expr):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def evaluate(x: object, symbol: sympy.Symbol, n: int) -> object:
    """A traced size (int, SymInt, sympy expression, or a tuple of them) at n tokens."""
    if isinstance(x, (tuple, list)):
        return tuple(evaluate(y, symbol, n) for y in x)
    if isinstance(x, (bool, float)):
        return x
    e = _expr(x).subs(symbol, n)
    if not e.is_Integer:
        raise ConfigError(f"size {x} depends on more than the token count")
    return int(e)


def allocate(value: Value, max_tokens: int, device: torch.device) -> torch.Tensor:
    """A zeroed buffer of `value` for up to `max_tokens` tokens, token-major (logical view)."""
    sizes = list(value.sizes)
    sizes[value.token_dim] *= max_tokens
    physical = torch.zeros([sizes[d] for d in value.perm], dtype=value.dtype, device=device)
    inverse = [value.perm.index(d) for d in range(len(sizes))]
    return physical.permute(inverse)


def rows(buffer: torch.Tensor, value: Value, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of `value`'s buffer."""
    c = value.rows_per_token
    return buffer.narrow(value.token_dim, start * c, (end - start) * c)

"""A model forward as a `Program`: the named ops of every layer with their buffer accesses.

The model (nanosched.models.model.CausalLM) runs any op on any token range of its workspace; this
module only declares what each op reads and writes, in token rows, so that the scheduler and
backend can order nano-ops without knowing the model. Buffer names are the workspace's fields;
`kv{l}` stands for layer l's K/V pages of the batch's tokens. Prefill attention reads the K/V
rows of its prompt's earlier tokens in the batch (a span back to the chunk's first row); decode
attention reads only its own row of this iteration (the rest is cache from earlier ones).

The two attention ops touch only their own kind of rows: on a range [s, e), decode attention
reads and writes the decode rows in it, prefill attention the prompt rows. Declaring the whole
range would make a range's attention of the other kind (a no-op: no rows of its kind) a writer
of `attn`, and prefill attention would wait behind it on the decode stream with no data to wait
for (docs/runtime.md has the measured cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanosched.models.ops import COMPUTE, OPS, OTHER, layer_ops
from nanosched.runtime.program import Access, LaunchConfig, Program, ProgramOp

# op -> (reads, writes) from the op table; "kv" means this layer's K/V rows
_ACCESSES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    op.name: (op.reads, op.writes) for op in OPS}


def prefill_span(segments: Sequence[tuple[int, int, bool]]):
    """Span of prefill attention: back to the first batch row of the chunk holding `start`.

    segments: (first row, end row, is_decode) of each request's slice of the batch, in order.
    """
    first_row: dict[int, int] = {}
    for lo, hi, is_decode in segments:
        if not is_decode:
            for t in range(lo, hi):
                first_row[t] = lo

    def span(start: int, end: int) -> tuple[int, int]:
        return first_row.get(start, start), end

    return span


def attention_spans(segments: Sequence[tuple[int, int, bool]]):
    """(decode rows, prefill rows, prefill K/V rows) of a range, as spans: decode rows come
    first in the batch, so a range's decode rows are its part below the first prompt row."""
    nd = next((lo for lo, _, is_decode in segments if not is_decode),
              segments[-1][1] if segments else 0)
    back = prefill_span(segments)

    def decode(start: int, end: int) -> tuple[int, int]:
        return min(start, nd), min(end, nd)

    def prefill(start: int, end: int) -> tuple[int, int]:
        return max(start, nd), max(end, nd)

    def prefill_kv(start: int, end: int) -> tuple[int, int]:
        lo, hi = prefill(start, end)
        return (back(lo, hi)[0] if lo < hi else lo), hi

    return decode, prefill, prefill_kv


def _launch_dict(cfg: LaunchConfig, op: str) -> dict[str, Any] | None:
    """What op `op` receives as `launch` (see nanosched/kernels/impls.py for the contract)."""
    return cfg.launch_dict(op)


def model_program(model: Any, ws: Any, meta: Any,
                  segments: Sequence[tuple[int, int, bool]]) -> Program:
    """The forward over the batch described by `meta`: embedding, then every layer's ops.
    A model that partitions itself (a `nanosched.frontend.FrontendModel`) builds its own."""
    if hasattr(model, "program"):
        return model.program(ws, meta, segments)
    num_tokens = segments[-1][1] if segments else 0
    decode, prefill, prefill_kv = attention_spans(segments)
    spans = {}  # an attention op's rows: its own kind's (module docstring)
    for op in OPS:
        if op.domain != "all":
            rows = decode if op.domain == "decode" else prefill
            for buf in (*op.reads, *op.writes):
                spans[(op.name, buf)] = prefill_kv if buf == "kv" and rows is prefill else rows
    ops = [ProgramOp("embed", -1, OTHER,
                     lambda s, e, cfg: model.embed(ws, meta, s, e),
                     (Access("token_ids"),), (Access("residual"), Access("normed")))]
    resources = {op.name: op.resource for op in layer_ops(model.spec, model.tp.size)}
    for layer in range(model.spec.num_layers):
        for name in model.op_names():
            reads, writes = _ACCESSES[name]

            def access(buf: str, name: str = name, layer: int = layer) -> Access:
                return Access(f"kv{layer}" if buf == "kv" else buf, spans.get((name, buf)))

            def run(s: int, e: int, cfg: LaunchConfig, layer: int = layer,
                    name: str = name) -> None:
                model.run_op(layer, name, ws, meta, s, e, launch=_launch_dict(cfg, name))

            ops.append(ProgramOp(name, layer, resources.get(name, COMPUTE), run,
                                 tuple(access(b) for b in reads),
                                 tuple(access(b) for b in writes)))
    return Program(num_tokens, tuple(ops))

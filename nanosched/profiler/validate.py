"""Validation of a profile (`nanosched.profile/1`), run on every load and save: every number
within what a GPU can measure and every op one of the model's layer (its fit to the model and
tp a search is asked for is `profiler.format.check_profile_for`).

Field types (finite numbers, integers) are checked when the file is read
(`fileio.check_fields`); here every time is positive (P = alone / co-run divides by them) and
within MIN_TIME_US..MAX_TIME_US (beyond either, the solver's integer ticks overflow or vanish),
an op's time inside a looped layer within 1/MAX_FORWARD_FACTOR..MAX_FORWARD_FACTOR of its row,
every ceiling below MAX_CEILING, every token count, context and SM count within what a GPU
holds, and every op (kernel rows, pairs, the forward table) an op of the profile's model at its
tp, so a hand-edited or foreign row is named rather than searched on.
"""

from __future__ import annotations

from nanosched.constants import MAX_SMS, MECHANISMS, QUANTIZATIONS
from nanosched.errors import ConfigError, ProfileError
from nanosched.models.ops import COLLECTIVE_FORMS, layer_ops
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import (
    MAX_TOKENS,
    RP_CLASSES,
    Ceilings,
    Profile,
    RPPoint,
)

MIN_TIME_US, MAX_TIME_US = 0.01, 1e8  # a kernel takes more than 10 ns and less than 100 s
MAX_FORWARD_FACTOR = 10.0  # an op inside a layer runs within 1/10..10x its row's time
MAX_CEILING = 1e6  # TFLOP/s or GB/s: a thousand times today's GPUs
MIN_CEILING = 1e-3  # TFLOP/s or GB/s: a GFLOP/s or a MB/s, below any GPU
MAX_ROW_TOKENS = 1 << 17  # tokens of one kernel row: 64 times the default dense batch cap
RP_MONOTONE_SLACK = 0.10  # measurement noise allowed against the direction of an R->P curve
MAX_CONTEXT = 1 << 21  # tokens of one request's context: past any model's positions (2M)


def validate_profile(prof: Profile, where: str = "profile") -> None:
    """Raise ProfileError naming the first problem (module docstring)."""
    if not 0 < prof.identity.num_sms <= MAX_SMS:
        raise ProfileError(f"{where}: identity.num_sms must be in 1..{MAX_SMS}, got "
                           f"{prof.identity.num_sms}")
    if not 0 < prof.dense_batch <= MAX_TOKENS:
        raise ProfileError(f"{where}: dense_batch must be in 1..{MAX_TOKENS}, got "
                           f"{prof.dense_batch}")
    try:
        prof.model.check_tp(prof.tp)
    except ConfigError as exc:
        raise ProfileError(f"{where}: tp: {exc}") from None
    _check_ceilings(prof.ceilings, where)
    if prof.quantization not in QUANTIZATIONS:
        raise ProfileError(f"{where}: quantization must be one of {QUANTIZATIONS}, got "
                           f"{prof.quantization!r}")
    if not prof.kernels:
        raise ProfileError(f"{where}: kernel table is empty")
    ops = profile_ops(prof.model, prof.tp)
    seen: dict[tuple, int] = {}
    for i, k in enumerate(prof.kernels):
        here = f"{where}: kernels[{i}] ({k.op}, {k.tokens} tokens)"
        key = tuple(v for name, v in vars(k).items() if name != "time_us")
        if key in seen:
            raise ProfileError(f"{here}: a second row of the same kernel, shape and launch "
                               f"as kernels[{seen[key]}] ({k.time_us:.3g} us against "
                               f"{prof.kernels[seen[key]].time_us:.3g} us); keep one")
        seen[key] = i
        if k.tokens > MAX_ROW_TOKENS:
            raise ProfileError(f"{here}: tokens {k.tokens} must be at most {MAX_ROW_TOKENS} "
                               f"(rows of one iteration: past what any GPU's KV cache batches)")
        _check_op(k.op, ops, here, prof)
        if k.mechanism not in MECHANISMS:
            raise ProfileError(f"{here}: mechanism {k.mechanism!r} not in {MECHANISMS}")
        if not (isinstance(k.time_us, (int, float)) and k.time_us > 0):
            raise ProfileError(f"{here}: time_us must be positive, got {k.time_us!r}")
        _check_time(k.time_us, f"{here}: time_us")
        if not 0 < k.sms <= prof.identity.num_sms:
            raise ProfileError(f"{here}: sms {k.sms} not in 1..{prof.identity.num_sms}")
        if not 0 < k.tokens <= MAX_TOKENS or not 0 <= k.context <= MAX_CONTEXT:
            raise ProfileError(f"{here}: tokens must be in 1..{MAX_TOKENS} and context in "
                               f"0..{MAX_CONTEXT}")
    for i, pr in enumerate(prof.pairs):
        here = f"{where}: pairs[{i}] ({pr.compute_op} x {pr.other_op})"
        times = (pr.compute_alone_us, pr.other_alone_us, pr.compute_us, pr.other_us)
        if not all(t > 0 for t in times) or pr.tokens <= 0 or pr.settle_ms < 0 \
                or pr.window_ms < 0:
            raise ProfileError(f"{here}: times and tokens must be positive, settle_ms and "
                               f"window_ms >= 0")
        for op in (pr.compute_op, pr.other_op):
            _check_op(op, ops, here, prof)
        for t in times:
            _check_time(t, f"{here}: a time")
    for i, r in enumerate(prof.forward):
        here = f"{where}: forward[{i}] ({r.op}, {r.batch_tokens} tokens)"
        if not (r.row_us > 0 and r.time_us > 0 and 0 < r.tokens <= r.batch_tokens <= MAX_TOKENS
                and 0 <= r.num_decode <= r.batch_tokens and 0 <= r.context <= MAX_CONTEXT
                and r.settle_ms >= 0 and r.window_ms >= 0):
            raise ProfileError(f"{here}: times must be positive, tokens in 1..batch_tokens, "
                               f"num_decode in 0..batch_tokens, settle_ms and window_ms >= 0")
        _check_op(r.op, ops, here, prof)
        _check_time(r.row_us, f"{here}: row_us")
        _check_time(r.time_us, f"{here}: time_us")
        if not 1 / MAX_FORWARD_FACTOR <= r.time_us / r.row_us <= MAX_FORWARD_FACTOR:
            raise ProfileError(f"{here}: time_us / row_us = {r.time_us / r.row_us:.3g}; an op "
                               f"inside a layer runs within 1/{MAX_FORWARD_FACTOR:g} and "
                               f"{MAX_FORWARD_FACTOR:g} times its row's time")
    for key, table in (("rp", prof.rp), ("rp_shapes", prof.rp_shapes)):
        for cls, pts in table.items():
            if cls not in RP_CLASSES:
                raise ProfileError(f"{where}: {key} class {cls!r} not in {RP_CLASSES}")
            for p in pts:
                _check_rp_point(p, f"{where}: {key}[{cls}] point r={p.r}")
            _check_rp_curves(pts, f"{where}: {key}[{cls}]")


def profile_ops(model: ModelSpec, tp: int) -> set[str]:
    """The op names a profile of `model` at `tp` may hold rows of: its layer's ops, the LM
    head (priced once per iteration) and, at tp > 1, the reduce-scatter / all-gather forms of
    each all-reduce."""
    names = {op.name for op in layer_ops(model, tp)} | {"lm_head"}
    if tp > 1:
        names |= {op.name for pair in COLLECTIVE_FORMS.values() for op in pair}
    return names


def _check_op(op: str, ops: set[str], here: str, prof: Profile) -> None:
    if op not in ops:
        raise ProfileError(f"{here}: op {op!r} is not an op of a {prof.model.name} layer at tp "
                           f"{prof.tp} (ops: {', '.join(sorted(ops))})")


def _check_time(t: float, here: str) -> None:
    if not MIN_TIME_US <= t <= MAX_TIME_US:
        raise ProfileError(f"{here} is {t:.3g} us; a measured time is within "
                           f"{MIN_TIME_US:g}..{MAX_TIME_US:g} us")


def _check_ceilings(c: Ceilings, where: str) -> None:
    if not (c.gemm_tflops_8192 > 0 and c.gemm_tflops_model > 0 and c.copy_gbs > 0):
        raise ProfileError(f"{where}: ceilings: gemm_tflops_8192, gemm_tflops_model and "
                           f"copy_gbs must be positive")
    for name in ("gemm_tflops_8192", "gemm_tflops_model", "copy_gbs", "allreduce_busbw_gbs"):
        value = getattr(c, name)
        if value is not None and not MIN_CEILING <= value <= MAX_CEILING:
            raise ProfileError(f"{where}: ceilings: {name} is {value:.3g}; it must be in "
                               f"{MIN_CEILING:g}..{MAX_CEILING:g}")
    lat = c.allreduce_latency_us
    if lat is not None and not 0 <= lat <= MAX_TIME_US:
        raise ProfileError(f"{where}: ceilings: allreduce_latency_us is {lat:.3g}; it must be "
                           f"in 0..{MAX_TIME_US:g}")


def _check_rp_curves(pts: tuple[RPPoint, ...] | list[RPPoint], here: str) -> None:
    """Within one curve (the points of one mechanism, implementation pair and shape) each r
    appears once, and giving the other op more of the GPU does not make it slower nor the
    compute op faster by more than `RP_MONOTONE_SLACK` (measured curves rise by 1.3% or more
    between points in every shipped profile)."""
    curves: dict[tuple, list[RPPoint]] = {}
    for p in pts:
        key = (p.mechanism, p.other_impl, p.compute_impl, p.compute_op, p.tokens, p.context)
        curves.setdefault(key, []).append(p)
    for (mech, other, impl, op, tokens, context), curve in curves.items():
        what = (f"{here} curve {mech}/{impl}" + (f"/{other}" if other else "")
                + (f" at {op} {tokens} tokens" if op else "")
                + (f" context {context}" if context else ""))
        curve = sorted(curve, key=lambda p: p.r)
        for a, b in zip(curve, curve[1:], strict=False):
            if b.r == a.r:
                raise ProfileError(f"{what}: two points at r={a.r:g}; a curve holds one per r")
            if b.p_other < a.p_other * (1 - RP_MONOTONE_SLACK):
                raise ProfileError(f"{what}: P of the other op falls from {a.p_other:.3g} at "
                                   f"r={a.r:.3g} to {b.p_other:.3g} at r={b.r:.3g}; it must "
                                   f"not fall as r grows")
            if b.p_compute > a.p_compute * (1 + RP_MONOTONE_SLACK):
                raise ProfileError(f"{what}: P of the compute op rises from {a.p_compute:.3g} "
                                   f"at r={a.r:.3g} to {b.p_compute:.3g} at r={b.r:.3g}; it "
                                   f"must not rise as the other op takes more of the GPU")


def _check_rp_point(p: RPPoint, here: str) -> None:
    if not (0 < p.r < 1 and 0 < p.p_other <= 1.5 and 0 < p.p_compute <= 1.5):
        raise ProfileError(f"{here}: r must be in (0, 1) and P in (0, 1.5]")
    if p.mechanism not in MECHANISMS:
        raise ProfileError(f"{here}: mechanism {p.mechanism!r} not in {MECHANISMS}")

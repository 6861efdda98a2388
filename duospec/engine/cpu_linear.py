"""``x @ weight.T + bias`` on the CPU in float32, through whichever GEMM kernel is fastest here.

Three kernels compute the same product (to float32 rounding): MKL on the weight as stored
(``F.linear``), MKL on a transposed copy (``x @ weight.T`` with the transpose made contiguous once),
and oneDNN on a prepacked copy. Which is fastest for how many rows depends on the machine and the
weight's shape, and not in a way a fixed rule gets right: on an Intel Xeon VM MKL won up to 8 rows for
a 768x256 weight and oneDNN from 4 rows for the 4096x256 LM head; on an AMD EPYC VM the transposed
MKL product was the fastest single row for every weight of the bundled target (25-30 % under
``F.linear`` inside a forward) and oneDNN's cost hardly grew from 1 to 8 rows — and a verify forward
is exactly 1 + k rows per sequence.

So the choice is measured once per weight shape at load (`kernel_choices`), on as many copies of the
weight as make the model's weight bytes: a forward reads each weight once, after every other weight,
so a product finds its weight where the rest of the model left the caches, not hot from the call
before. Measured hot instead (each product timed on its own), the choice flipped between loads on the AMD VM and
mostly kept ``F.linear``, with which the bundled target's 1- and 2-row forwards ran 20-30 % slower
than with the choice measured this way (benchmarks/cpu_kernels.py).

A drafter's weights (``approximate``) are also measured in float16: input and weight rounded to half,
the result back in float32. A draft's logits only choose what is proposed (the target verifies every
token, and a sampled draft sends the q it drew from), so rounding can cost acceptance, never exactness.
On the AMD EPYC VM a one-row product of the SmolLM2 draft's weights ran 2-4x faster in float16 (half
the bytes to read; the forward is bound by reading its weights), its forward 4.4 -> 3.1 ms, and its
argmax equalled float32's on 700 of 700 positions of held-out code. A target never gets this kernel.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import os
import time
from bisect import bisect_right

import torch
import torch.nn.functional as F

__all__ = ["CALIBRATE_ROWS", "Kernel", "PACKED_LINEAR_ENV", "CpuLinear", "available_kernels",
           "copies_for", "half_linear_works", "kernel_choices", "packed_linear_works"]

log = logging.getLogger(__name__)

# Set DUOSPEC_PACKED_LINEAR=0 to leave oneDNN out (the two MKL products are still measured).
PACKED_LINEAR_ENV = "DUOSPEC_PACKED_LINEAR"
# Weights below MEASURE_MIN_ELEMENTS stay plain F.linear: a product that small is mostly the call's
# fixed cost, whichever kernel runs it.
MEASURE_MIN_ELEMENTS = 1 << 14
# Weights up to CALIBRATE_MAX_ELEMENTS are measured; bigger ones (milliseconds per product, seconds
# per shape to measure) run oneDNN for every row count, as the old fixed rule did.
CALIBRATE_MAX_ELEMENTS = 1 << 23
# The row counts measured; a product of r rows runs the kernel measured fastest at the largest of
# these <= r.
CALIBRATE_ROWS = (1, 2, 4, 8, 16)
# The copies of a weight the measurement cycles through, over all kernels: at most this many bytes
# (colder than any last-level cache, so more would only cost load time).
_POOL_MAX_BYTES = 64 << 20
# Weights too big for the cache: oneDNN's kernel for 1-2 rows is slower than for 3-5 (measured: a
# 2304x768 weight takes 525/602 µs for 1/2 rows, 388 µs for 4), so its products of 1-3 rows with such
# weights run padded to 4 rows.
PAD_MIN_ELEMENTS = 1_500_000
PAD_ROWS = 4


class Kernel(enum.Enum):
    PLAIN = "F.linear"
    TRANSPOSED = "x @ weight.T (contiguous)"
    ONEDNN = "oneDNN prepacked"
    HALF = "float16 weight and input, float32 result (drafts only)"


@functools.cache
def packed_linear_works() -> bool:
    """Whether oneDNN's prepacked float32 linear runs here and agrees with F.linear."""
    if os.environ.get(PACKED_LINEAR_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(shape, generator=gen) for shape in ((64, 32), (64,), (5, 32)))
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 8), b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4))
    except Exception as exc:  # an op missing from this torch build
        log.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


def _layout(weight: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """The weight as `kernel` reads it."""
    if kernel is Kernel.PLAIN:
        return weight
    if kernel is Kernel.TRANSPOSED:
        return weight.t().contiguous()
    if kernel is Kernel.HALF:
        return weight.half()
    return torch.ops.mkldnn._reorder_linear_weight(weight, 8)


def _product(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             pad: bool) -> torch.Tensor:
    """`x @ W.T + bias` with `weight` in `kernel`'s layout (`_layout`)."""
    if kernel is Kernel.PLAIN:
        return F.linear(x, weight, bias)
    if kernel is Kernel.TRANSPOSED:
        return x @ weight if bias is None else torch.addmm(bias, x, weight)
    if kernel is Kernel.HALF:
        out = F.linear(x.half(), weight)
        if not torch.isfinite(out).all():
            # An input or an output beyond float16's range (65504): the product again on the input
            # scaled to at most 1 in magnitude, the scale put back in float32.
            scale = x.abs().amax().clamp_min(1.0)
            out = F.linear((x / scale).half(), weight).float().mul_(scale)
        out = out.float()
        return out if bias is None else out.add_(bias)
    rows = x.shape[0]
    if pad and rows < PAD_ROWS:
        padded = F.pad(x, (0, 0, 0, PAD_ROWS - rows))
        return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@functools.cache
def half_linear_works() -> bool:
    """Whether a float16 product runs here and is close to float32 (a drafter's approximate kernel)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(64, 32, generator=gen), torch.randn(5, 32, generator=gen)
        got = _product(Kernel.HALF, x, _layout(w, Kernel.HALF), None, False)
        return bool(torch.allclose(got, F.linear(x, w), rtol=1e-2, atol=5e-2))
    except Exception as exc:  # no float16 GEMM in this torch build
        log.info("float16 linear unavailable (%s); drafters multiply in float32", exc)
        return False


def available_kernels(approximate: bool = False) -> tuple[Kernel, ...]:
    """The kernels this torch build runs: both MKL products always, oneDNN where it works, and with
    `approximate` (a drafter's weights) the float16 product where it works."""
    return ((Kernel.PLAIN, Kernel.TRANSPOSED) + ((Kernel.ONEDNN,) if packed_linear_works() else ())
            + ((Kernel.HALF,) if approximate and half_linear_works() else ()))


@functools.cache
def kernel_choices(out_features: int, in_features: int, copies: int = 1, kernels: tuple[Kernel, ...] | None = None,
                   repeats: int = 5) -> tuple[Kernel, ...]:
    """The fastest of `kernels` (default: `available_kernels()`) for each row count of CALIBRATE_ROWS,
    for this weight shape on this machine, measured on random data. Each kernel cycles through its
    own `copies` copies of the weight, and the kernels' calls are interleaved, so drift hits all of
    them and between two reads of one copy the caches see every other copy of every kernel. Never
    more than two layouts: a third would cost a third copy of the weight for the rest of the process,
    so the kernel that wins fewest row counts gives them to the faster of the other two."""
    kernels = available_kernels() if kernels is None else kernels
    if out_features * in_features > CALIBRATE_MAX_ELEMENTS:
        return ((Kernel.ONEDNN if Kernel.ONEDNN in kernels else Kernel.PLAIN),) * len(CALIBRATE_ROWS)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(copies)]
    pools = {k: [_layout(w, k) for w in weights] for k in kernels}
    del weights
    pad = out_features * in_features >= PAD_MIN_ELEMENTS
    medians: list[dict[Kernel, float]] = []
    for rows in CALIBRATE_ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        cursor = {k: itertools.cycle(pools[k]) for k in kernels}

        def call(kernel: Kernel) -> None:
            _product(kernel, x, next(cursor[kernel]), None, pad)

        for kernel in kernels:  # warm-up: the first call of a kernel pays its own set-up
            call(kernel)
        times: dict[Kernel, list[float]] = {k: [] for k in kernels}
        for _ in range(repeats):
            for kernel in kernels:
                times[kernel].append(_median_s(lambda: call(kernel), 3))
        medians.append({k: sorted(t)[repeats // 2] for k, t in times.items()})
    choices = [min(m, key=m.get) for m in medians]
    if len(set(choices)) > 2:
        dropped = min(set(choices), key=choices.count)
        choices = [k if k is not dropped else min((j for j in m if j is not dropped), key=m.get)
                   for k, m in zip(choices, medians)]
    log.debug("linear %dx%d (%d copies): %s", out_features, in_features, copies,
              ", ".join(f"{r} rows {k.name}" for r, k in zip(CALIBRATE_ROWS, choices)))
    return tuple(choices)


def copies_for(weight_bytes: int, model_weight_bytes: int, n_kernels: int = 3) -> int:
    """How many copies of a weight each of `n_kernels` kernels cycles through so that all of them
    together make the model's working set (at least one copy each; at most _POOL_MAX_BYTES in all)."""
    budget = min(model_weight_bytes, _POOL_MAX_BYTES)
    return max(1, budget // max(n_kernels * weight_bytes, 1))


class CpuLinear:
    """``x @ weight.T + bias`` for 2-D ``x``, through the kernel measured fastest for its row count.

    With `measure` off (not float32 on the CPU) or a weight too small for the kernel to matter, it is
    plain F.linear. `model_weight_bytes` (float32 bytes of every weight a forward multiplies by)
    sizes the measurement's working set (module docstring). `approximate`: the weight is a drafter's,
    whose products need not be float32's to the last bit, so the float16 kernel is measured too."""

    __slots__ = ("shape", "bias", "choices", "weights", "pad")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, measure: bool,
                 model_weight_bytes: int = 0, approximate: bool = False) -> None:
        self.shape = tuple(weight.shape)  # [out_features, in_features]
        self.bias = bias
        if measure and weight.numel() >= MEASURE_MIN_ELEMENTS:
            kernels = available_kernels(approximate)
            copies = copies_for(weight.numel() * 4, model_weight_bytes, len(kernels))
            self.choices = kernel_choices(*weight.shape, copies, kernels)
        else:
            self.choices = (Kernel.PLAIN,) * len(CALIBRATE_ROWS)
        self.weights = {kernel: _layout(weight, kernel) for kernel in set(self.choices)}
        self.pad = weight.numel() >= PAD_MIN_ELEMENTS

    def kernel(self, rows: int) -> Kernel:
        return self.choices[max(0, bisect_right(CALIBRATE_ROWS, rows) - 1)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x.shape[0])
        return _product(kernel, x, self.weights[kernel], self.bias, self.pad)

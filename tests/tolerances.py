"""Numeric tolerances derived from the dtype and the magnitude compared, never from one machine.

A result computed in a dtype with machine epsilon eps differs from an independent computation
of the same value by rounding: a few units of eps times the size of the quantities it was
computed from (not only of the result: cos(x) inherits eps * |x| from its angle, a dot product
eps * sum |a_i b_i|). Independent roundings over an accumulation of n terms grow like sqrt(n).
So every comparison states its dtype, the magnitude its error scales with, and the accumulation
length; ``ulps`` (default 8) covers the tail of the rounding-error distribution, and stays far
below the error of any real bug (a wrong index, sign or scale is off by O(magnitude)).
"""

from __future__ import annotations

import math

import numpy as np

# Spacing of the dtype's numbers at 1.0.
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10,
       "bfloat16": 2.0 ** -7, "float8_e4m3fn": 2.0 ** -3}


def eps(dtype) -> float:
    """Machine epsilon of a torch dtype, numpy dtype or name ('float32', torch.bfloat16, ...)."""
    name = str(dtype).replace("torch.", "")
    if name not in EPS:
        name = np.dtype(dtype).name
    return EPS[name]


def _array(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def bound(dtype, magnitude, terms: int = 1, ulps: float = 8.0):
    """The largest rounding difference expected for values of `magnitude` (scalar or array)
    computed in `dtype` through ~`terms` accumulated operations."""
    return ulps * eps(dtype) * np.asarray(magnitude, dtype=np.float64) * math.sqrt(max(terms, 1))


def assert_close(actual, expected, dtype, *, magnitude=None, terms: int = 1, ulps: float = 8.0,
                 compute=None, msg: str = "") -> None:
    """|actual - expected| <= bound(compute, magnitude, terms, ulps) + 2 ulp of dtype at
    |expected|, elementwise (NaNs must match).

    dtype: the dtype of the compared values (their final rounding: one ulp on each side).
    compute: the precision they were computed in before that rounding (default: dtype), e.g.
    float32 accumulation behind a bfloat16 output.
    magnitude: what the computation's error scales with; default max |expected|; may be an
    array that broadcasts to `expected` (e.g. the rotation angle of each rope entry).
    """
    a, e = _array(actual), _array(expected)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape} {msg}"
    nan = np.isnan(e)
    assert np.array_equal(np.isnan(a), nan), f"NaN positions differ {msg}"
    a, e = np.where(nan, 0.0, a), np.where(nan, 0.0, e)
    if magnitude is None:
        magnitude = np.abs(e).max() if e.size else 0.0
    limit = bound(compute or dtype, magnitude, terms, ulps) + 2 * eps(dtype) * np.abs(e)
    err = np.abs(a - e)
    over = err > limit
    if over.any():
        i = np.unravel_index(np.argmax(err - limit), err.shape)
        raise AssertionError(
            f"{int(over.sum())} of {err.size} values differ by more than the {dtype} rounding "
            f"bound (ulps={ulps}, terms={terms}); worst at {tuple(int(j) for j in i)}: "
            f"{a[i]!r} vs {e[i]!r}, |diff| {err[i]:.3g} > {np.broadcast_to(limit, err.shape)[i]:.3g}"
            f" {msg}")

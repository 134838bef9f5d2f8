"""The torch statistics path against an independent numpy reference, exact counts, every format."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy_ref import reference_stats

from ampdoctor.formats import FORMATS, get_format
from ampdoctor.stats import batch_stats, decode_row, row_width, tensor_stats

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
if hasattr(torch, "float8_e4m3fn"):
    FLOAT_DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]
FORMAT_NAMES = sorted(FORMATS)

SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, 65504.0, 65520.0, 7e4, 1e5, 3e38, 448.0, 449.0, 57344.0,
            6.1e-5, 6.103515625e-05, 6.0e-5, 5.96e-8, 5.960464477539063e-08, 3e-8, 1e-9, 1e-30, 1e-40, 1e-45,
            0.001953125, 1.52587890625e-05, 1.0, -1.0, 2.0, 0.5]


def _compare(t: torch.Tensor, fmt_name: str) -> None:
    fmt = get_format(fmt_name)
    got = decode_row(tensor_stats(t, fmt).tolist(), fmt)
    ref = reference_stats(t.to(torch.float64).numpy() if t.dtype != torch.float64 else t.numpy(), fmt)
    for key, val in ref.items():
        if key in ("min", "max", "absmax", "nzmin"):
            assert got[key] == val or (math.isnan(got[key]) and math.isnan(val)), (key, got[key], val)
        else:
            assert got[key] == val, (key, got[key], val)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                              st.sampled_from(SPECIALS)), min_size=0, max_size=200),
    dtype=st.sampled_from(FLOAT_DTYPES),
    fmt=st.sampled_from(FORMAT_NAMES),
)
def test_stats_match_numpy_reference(values, dtype, fmt):
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    _compare(t, fmt)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_specials_every_format_and_dtype(fmt, dtype):
    t = torch.tensor(SPECIALS * 3, dtype=torch.float64).to(dtype)
    _compare(t, fmt)


def test_known_fp16_counts():
    fmt = get_format("fp16")
    x = torch.tensor([1e5, -3.0, math.nan, math.inf, 0.0, 1e-6, 1e-9, 7e4, -math.inf], dtype=torch.float32)
    d = decode_row(tensor_stats(x, fmt).tolist(), fmt)
    assert (d["nan"], d["posinf"], d["neginf"], d["zero"]) == (1, 1, 1, 1)
    assert d["overflow"] == 2 and d["subnormal"] == 1 and d["flush_to_zero"] == 1
    assert d["absmax"] == 1e5 and d["min"] == -3.0 and d["max"] == 1e5
    assert sum(d["hist"]) == 5  # finite non-zero values only
    assert d["hist"][-1] == 2   # 1e5 and 7e4 are >= 2**16: the over bin
    assert fmt.min_exp == -24 and fmt.max_exp == 15 and fmt.n_bins == 42


def test_format_ranges_from_finfo():
    f = get_format("fp16")
    assert (f.max, f.smallest_normal, f.smallest_subnormal) == (65504.0, 2.0**-14, 2.0**-24)
    b = get_format("bf16")
    assert b.smallest_subnormal == 2.0**-133 and b.max_exp == 127
    if "fp8_e4m3fn" in FORMATS:
        e4 = get_format("fp8_e4m3fn")
        assert (e4.max, e4.smallest_normal, e4.smallest_subnormal) == (448.0, 2.0**-6, 2.0**-9)
        e5 = get_format("fp8_e5m2")
        assert (e5.max, e5.smallest_normal, e5.smallest_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert get_format(torch.float16) is f and get_format("half") is f
    with pytest.raises(ValueError, match="unknown format"):
        get_format("fp12")


def test_empty_and_batch():
    fmt = get_format("fp16")
    rows = batch_stats([torch.zeros(0), torch.ones(3), torch.full((2, 2), 1e6)], fmt)
    assert rows.shape == (3, row_width(fmt))
    d0, d1, d2 = (decode_row(r.tolist(), fmt) for r in rows)
    assert d0["numel"] == 0 and d0["absmax"] == 0.0 and d0["min"] == math.inf
    assert d1["numel"] == 3 and d1["hist"][1 + 0 - fmt.min_exp] == 3
    assert d2["overflow"] == 4


def test_large_random_tensor_matches_reference():
    x = torch.randn(10_000, dtype=torch.float32) * torch.exp(torch.randn(10_000) * 12)
    x[::97] = math.nan
    x[::101] = math.inf
    for fmt in FORMAT_NAMES:
        _compare(x, fmt)
    _compare(x.half(), "fp16")
    _compare(x.bfloat16(), "bf16")
    assert np.isfinite(1.0)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                                       st.sampled_from(SPECIALS)), min_size=0, max_size=60), min_size=2, max_size=5),
    dtypes=st.lists(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]), min_size=5,
                    max_size=5),
    fmt=st.sampled_from(FORMAT_NAMES),
)
def test_batched_rows_match_numpy_reference(groups, dtypes, fmt):
    """The batched path (one pass for many tensors, exponent bits instead of frexp) against numpy."""
    f = get_format(fmt)
    tensors = [torch.tensor(v, dtype=torch.float64).to(dt) for v, dt in zip(groups, dtypes)]
    rows = batch_stats(tensors, f)
    for t, row in zip(tensors, rows):
        got = decode_row(row.tolist(), f)
        ref = reference_stats(t.to(torch.float64).numpy(), f)
        for key, val in ref.items():
            assert got[key] == val, (key, got[key], val, t.dtype)

"""The FP8 KV pool on the CPU: store_kv_fp8 against torch's own e4m3 rounding, and
paged_attention_fp8 against float attention over the same pool dequantized by torch."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernel import reference as ref
from freetoken.kernel.loader import get_function
from tests.kernel.test_cpu_kernels import MIXED, close, make_attention_case

E4M3_MAX = ref.E4M3_MAX


def store_kv_fp8(*args):
    get_function("kv_cache", "store_kv_fp8")(*args)


def paged_attention_fp8(*args):
    get_function("attention", "paged_attention_fp8")(*args)


def empty_pool(slots: int, hk: int, d: int):
    return (torch.full((slots, hk, d), 0x55, dtype=torch.uint8),
            torch.full((slots, hk), 7.0, dtype=torch.float32))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_fp8_rounds_as_torch_does(src_dtype):
    """Rows spanning five decades (subnormal e4m3 codes included), an all-zero row, a skipped
    slot: codes and scales bit-equal to torch's; untouched slots keep their bytes."""
    t, hk, d, slots = 6, 3, 64, 40
    g = torch.Generator().manual_seed(3)
    decades = 10.0 ** (-4 * torch.rand(t, hk, d, generator=g))
    k = (torch.randn(t, hk, d, generator=g) * decades * 30).to(src_dtype)
    v = (torch.randn(t, hk, d, generator=g) * decades).to(src_dtype)
    k[2, 1] = 0.0
    slot_mapping = torch.tensor([7, -1, 39, 0, 16, 5])
    k_codes, k_scale = empty_pool(slots, hk, d)
    v_codes, v_scale = empty_pool(slots, hk, d)
    store_kv_fp8(k, v, k_codes, v_codes, k_scale, v_scale, slot_mapping)
    keep = slot_mapping >= 0
    for x, codes, scale in ((k, k_codes, k_scale), (v, v_codes, v_scale)):
        want_codes, want_scale = ref.quantize_fp8_rows(x[keep])
        assert torch.equal(scale[slot_mapping[keep]], want_scale)
        assert torch.equal(codes[slot_mapping[keep]], want_codes)
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[slot_mapping[keep]] = False
        assert (codes[untouched] == 0x55).all() and (scale[untouched] == 7.0).all()
    assert (k_scale[39, 1] == 1.0) and (k_codes[39, 1] == 0).all()   # the zero row
    assert (k_codes.view(torch.float8_e4m3fn).float().abs() <= E4M3_MAX).all()


def test_fp8_error_is_bounded_by_half_a_step_of_the_row():
    """|dequantized - x| <= half an e4m3 step at x's magnitude (2^-4 relative for normals),
    or half the subnormal step (2^-10 of the row's scale)."""
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(4)) * 5
    codes, scales = empty_pool(64, 4, 128)
    store_kv_fp8(x, x, codes, codes.clone(), scales, scales.clone(), torch.arange(64))
    err = (ref.dequantize_fp8_rows(codes, scales) - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -4, scales[..., None] * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 1, 128), (4, 4, 100)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_attention_fp8_is_float_attention_over_the_dequantized_pool(hq, hk, d, q_dtype,
                                                                          window):
    """Decode rows, a fresh prefill, a chunk over a cached prefix, an idle sequence and a long
    one in one call; the reference reads the same codes and scales, dequantized by torch."""
    q, kf, vf, bt, sl, qsl = make_attention_case(*MIXED, hq, hk, d, 16, q_dtype, torch.float32,
                                                 seed=hq + d)
    slots = kf.shape[0]
    k_codes, k_scale = empty_pool(slots, hk, d)
    v_codes, v_scale = empty_pool(slots, hk, d)
    store_kv_fp8(kf, vf, k_codes, v_codes, k_scale, v_scale, torch.arange(slots))
    out = torch.full(q.shape, float("nan"), dtype=q_dtype)
    paged_attention_fp8(out, q, k_codes, v_codes, k_scale, v_scale, bt, sl, qsl, 16, d ** -0.5,
                        window)
    want = torch.empty_like(out)
    keys, values = (ref.dequantize_fp8_rows(k_codes, k_scale),
                    ref.dequantize_fp8_rows(v_codes, v_scale))
    ref.paged_attention(want, q, keys, values, bt, sl, qsl, 16, d ** -0.5, window)
    close(out, want, q_dtype, terms=max(MIXED[1]) + d, magnitude=values.abs().max())


def test_fp8_pool_arguments_are_checked_by_name():
    q, kf, vf, bt, sl, qsl = make_attention_case([1], [9], 4, 2, 64, 16, torch.float32,
                                                 torch.float32, seed=1)
    codes, scales = empty_pool(kf.shape[0], 2, 64)
    out = torch.empty_like(q)
    with pytest.raises(Exception, match="k_cache"):
        paged_attention_fp8(out, q, kf, vf, scales, scales, bt, sl, qsl, 16, 0.125, 0)
    with pytest.raises(Exception, match="v_scale"):
        paged_attention_fp8(out, q, codes, codes, scales, scales[:, :1].contiguous(), bt, sl, qsl,
                            16, 0.125, 0)
    with pytest.raises(Exception, match="k_scale"):
        store_kv_fp8(kf[:1], vf[:1], codes, codes, scales.double(), scales,
                     torch.tensor([0]))
    with pytest.raises(Exception, match="outside the KV pool"):
        store_kv_fp8(kf[:1], vf[:1], codes, codes, scales, scales,
                     torch.tensor([kf.shape[0]]))

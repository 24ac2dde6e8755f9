"""GGUF Q4_0/Q4_1/Q8_0 rows packed 16 wide for AVX-512 VNNI (quant_pack, quant_matmul_packed):
the layout against a numpy restatement of quant_packed.h, the product against the `gguf`
package's dequantizer, and bad input refused. Skipped on a CPU without AVX-512 VNNI, where
nothing is packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function
from tests.kernel import gguf_blocks as gb
from tests.tolerances import assert_close

pytestmark = pytest.mark.skipif(ops.cpu_isa() != "avx512",
                                reason="packed weights need AVX-512 VNNI")

TYPES = (gb.Q4_0, gb.Q4_1, gb.Q8_0)
# (M, K, N): decode (one tile; many tiles, so chunks prefetch into the next), prefill tiles of
# four activation rows plus each remainder
SHAPES = [(1, 32, 16), (1, 576, 960), (1, 64, 2048), (2, 96, 32), (3, 288, 48), (4, 64, 16),
          (9, 1536, 64)]


def numpy_pack(rows: np.ndarray, qtype: int) -> np.ndarray:
    """The packed layout as quant_packed.h describes it, restated with numpy."""
    n, row_bytes = rows.shape
    bb = gb.block_bytes(qtype)[1]
    heads = 2 if qtype == gb.Q4_1 else 1
    blocks = rows.reshape(n // 16, 16, row_bytes // bb, bb).transpose(0, 2, 1, 3)  # [t, b, n, bb]
    scales = blocks[..., : 2 * heads].reshape(*blocks.shape[:3], heads, 2).transpose(0, 1, 3, 2, 4)
    words = blocks[..., 2 * heads:].reshape(*blocks.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)
    if qtype == gb.Q8_0:
        words = words ^ 0x80
    tile_blocks = np.concatenate([scales.reshape(*blocks.shape[:2], -1),
                                  words.reshape(*blocks.shape[:2], -1)], axis=-1)
    return np.ascontiguousarray(tile_blocks.reshape(n, row_bytes))


def int8_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers with max |x| = 127 in every 32-block: the kernel's int8 rounding is exact."""
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(seed)).float()
    x.view(m, -1, 32)[:, :, 5] = 127.0
    return x


def packed(rows: np.ndarray, qtype: int) -> torch.Tensor:
    out = torch.empty(rows.shape, dtype=torch.uint8)
    ops.quant_pack(out, torch.from_numpy(rows), qtype)
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_pack_writes_the_documented_layout(qtype):
    rows = gb.random_rows(48, 96, qtype, seed=qtype)
    assert np.array_equal(packed(rows, qtype).numpy(), numpy_pack(rows, qtype))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_packed_matmul_against_gguf_dequantize(qtype, m, k, n):
    rows = gb.random_rows(n, k, qtype, seed=m * k + n + qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = int8_activations(m, k, seed=k + qtype)
    out = torch.full((m, n), float("nan"))
    ops.quant_matmul_packed(out, x, packed(rows, qtype), qtype)
    # float32 accumulation over K products of exact integers and f16-derived scales
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, x.double().numpy() @ w.T, torch.float32, magnitude=magnitude, terms=k)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_matches_gguf_layout_on_real_activations(qtype):
    """Both layouts quantize x the same way, so they differ only in float summation order."""
    m, k, n = 5, 576, 64
    rows = gb.random_rows(n, k, qtype, seed=7 + qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype))
    out, want = torch.empty(m, n), torch.empty(m, n)
    ops.quant_matmul_packed(out, x, packed(rows, qtype), qtype)
    ops.quant_matmul(want, x, torch.from_numpy(rows), qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, want, torch.float32, magnitude=magnitude, terms=k)


def test_packed_threads_do_not_change_results():
    rows = gb.random_rows(512, 576, gb.Q4_1, seed=3)
    w = packed(rows, gb.Q4_1)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    set_threads = get_function("quant_gemm", "set_num_threads", "cpu")
    outs = []
    for threads in (1, 0):
        set_threads(threads)
        outs.append(torch.empty(1, 512))
        ops.quant_matmul_packed(outs[-1], x, w, gb.Q4_1)
    assert torch.equal(outs[0], outs[1])


def test_pack_refuses_bad_input():
    rows = torch.from_numpy(gb.random_rows(24, 64, gb.Q4_1, seed=1))
    with pytest.raises(Exception, match="multiple of 16 rows"):
        ops.quant_pack(torch.empty_like(rows), rows, gb.Q4_1)
    k_rows = torch.from_numpy(gb.random_rows(16, 256, gb.Q4_K, seed=1))
    with pytest.raises(Exception, match="no packed layout"):
        ops.quant_pack(torch.empty_like(k_rows), k_rows, gb.Q4_K)
    rows = rows[:16].contiguous()
    with pytest.raises(Exception, match="in place"):
        ops.quant_pack(rows, rows, gb.Q4_1)
    with pytest.raises(Exception, match="shape"):
        ops.quant_pack(torch.empty(16, 20, dtype=torch.uint8), rows, gb.Q4_1)
    with pytest.raises(Exception, match="multiple of 16 rows"):
        ops.quant_matmul_packed(torch.empty(1, 24), torch.randn(1, 64),
                                torch.from_numpy(gb.random_rows(24, 64, gb.Q4_1, seed=2)), gb.Q4_1)

"""The GPU placement of GGUF blocks, run on the CPU: a torch "device" whose kernels are the
torch references (kernel/reference.py, and gguf's numpy dequantizer behind gguf_matmul), so the
loader, the fused row parts, QuantLinear's GPU branch and the quantized embedding are checked
here; tests/models/test_gguf_gpu.py runs the same model on the real kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.arrays import Device, TorchArrays
from freetoken.kernel import ops, reference
from freetoken.models import loader
from freetoken.models.config import QuantWeight
from freetoken.models.forward.linear import DenseLinear, PartsLinear, QuantLinear
from tests.kernel.gguf_random import dequantize
from tests.models.helpers import PagedRunner
from tests.models.test_gguf_gpu import K_MIX, REL_TOL, _k_quant_file

_FLOAT_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "store_kv", "silu_and_mul",
              "embedding")


def _gguf_matmul(out, x, qweight, qtype):
    w = torch.from_numpy(dequantize(qweight.numpy(), qtype)).double()
    out.copy_((x.double() @ w.T).to(out.dtype))


def _gguf_dequantize_rows(out, ids, qweight, qtype):
    out.copy_(torch.from_numpy(dequantize(qweight[ids].numpy(), qtype)).to(out.dtype))


def _paged_attention(out, q, k_cache, v_cache, *args):
    reference.paged_attention(out, q, k_cache, v_cache, *args[:6])   # no GPU workspace


class _HostTorch(TorchArrays):
    """TorchArrays that says "cuda" but keeps its tensors in host memory."""

    def __init__(self):
        super().__init__(Device("cuda"))
        self.torch_device = torch.device("cpu")


@pytest.fixture
def fake_gpu(monkeypatch):
    for name in _FLOAT_OPS:
        monkeypatch.setattr(ops, name, getattr(reference, name))
    monkeypatch.setattr(ops, "paged_attention", _paged_attention)
    monkeypatch.setattr(ops, "gguf_matmul", _gguf_matmul)
    monkeypatch.setattr(ops, "gguf_dequantize_rows", _gguf_dequantize_rows)
    monkeypatch.setattr(loader, "resolve_device", lambda device: Device(device))
    monkeypatch.setattr(loader, "arrays_for", lambda device: (
        _HostTorch() if not device.is_cpu else loader.HostArrays()))


def test_k_quant_blocks_stay_as_uint8_tensors_and_match_dequantized_floats(fake_gpu, tmp_path):
    path, raw = _k_quant_file(tmp_path)
    quant = loader.load_model(str(path), device="cuda")          # bf16: blocks kept
    floats = loader.load_model(str(path), device="cuda", dtype="float32")
    attn, mlp = quant.model.layers[1].attn, quant.model.layers[1].mlp
    # q and k share a block type: one matrix; v stays apart
    assert K_MIX["attn_q"] == K_MIX["attn_k"] != K_MIX["attn_v"]
    assert isinstance(attn.qkv, PartsLinear) and [p.qtype for p in attn.qkv.parts] == [
        K_MIX["attn_q"], K_MIX["attn_v"]]
    assert all(p.strided_out for p in attn.qkv.parts)
    assert isinstance(mlp.gate_up, QuantLinear) and mlp.gate_up.data.dtype == torch.uint8
    expected = np.concatenate([raw["blk.1.ffn_gate.weight"][0], raw["blk.1.ffn_up.weight"][0]])
    assert np.array_equal(mlp.gate_up.data.numpy(), expected)
    assert isinstance(quant.model._embed, QuantWeight)
    assert isinstance(floats.model.layers[1].mlp.gate_up, DenseLinear)
    prompt = list(range(3, 40))
    a = PagedRunner(quant.model).step([(0, prompt)])[0].float()
    b = PagedRunner(floats.model).step([(0, prompt)])[0].float()
    assert (a - b).abs().max() < REL_TOL * b.abs().max()

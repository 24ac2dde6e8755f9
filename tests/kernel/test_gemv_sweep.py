"""benchmarks/gemv_sweep.py's parts that need no GPU: the configurations it times, the check
that compares them (run here with the plain-torch references on the CPU) and the TUNED lines
it prints for fused_decode."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gemv_sweep
from freetoken.kernel import ops, reference
from freetoken.models.forward import fused_decode


@pytest.fixture
def cpu_sweep(monkeypatch):
    for name in ("decode_gemv", "decode_gemv_add", "decode_gemv_swiglu", "rms_norm"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    monkeypatch.setattr(gemv_sweep, "DEVICE", "cpu")


def _reordered(case):
    """The projection with K summed in another f32 order (8-wide chunks, last chunk first),
    rounded where the unfused chain rounds: what another correct kernel may return."""
    x = case.x
    if case.projection != "add":
        x = torch.empty_like(case.x)
        reference.rms_norm(x, case.x, case.norm, gemv_sweep.NORM_EPS)
    t, k = x.shape
    prod = x.float()[:, None, :] * case.weights[0].float()[None, :, :]
    y = prod.view(t, -1, k // 8, 8).sum(-1).flip(-1).sum(-1)
    dtype = gemv_sweep.DTYPE
    if case.projection == "qkv":
        return y.to(dtype)
    if case.projection == "add":
        return (case.residual.float() + y.to(dtype).float()).to(dtype)
    gate, up = y[:, :case.n].to(dtype).float(), y[:, case.n:].to(dtype).float()
    return (torch.nn.functional.silu(gate) * up).to(dtype)


@pytest.mark.parametrize("projection,n,k", [("qkv", 96, 576), ("add", 64, 1536),
                                            ("swiglu", 80, 576)])
@pytest.mark.parametrize("t", [1, 4])
def test_the_check_passes_another_order_and_fails_a_wrong_row(cpu_sweep, projection, n, k, t):
    case = gemv_sweep.Case(projection, n, k, t, l2_bytes=1 << 16)
    want, limit = case.result((0, 32, True)), case.tolerance()
    other = _reordered(case)
    assert ((other.float() - want.float()).abs() <= limit).all()
    # one output row whose sum lost a quarter of its terms (a wrong split of K)
    partial = case.x.float()[:, : 3 * k // 4] @ case.weights[0].float()[:n, : 3 * k // 4].T
    wrong = want.clone()
    wrong[:, 0] = partial[:, 0].to(wrong.dtype) if projection == "qkv" else want[:, 0] + 0.2
    assert not ((wrong.float() - want.float()).abs() <= limit).all()


def test_configs_fit_the_blocks_and_the_rows():
    case = gemv_sweep.Case.__new__(gemv_sweep.Case)
    case.projection, case.k = "qkv", 576
    seen = list(gemv_sweep.configs(case))
    assert {v for v, _, _ in seen} == set(range(len(fused_decode.GEMV_VARIANTS)))
    for variant, group, _ in seen:
        assert group <= fused_decode.GEMV_VARIANTS[variant].threads and 576 // 8 >= group
    assert {(g, p) for v, g, p in seen if v == 0} == {(32, True), (32, False), (64, True),
                                                      (64, False)}


def test_tuned_lines_paste_into_the_table():
    def result(name, t, default_us, best_us, config):
        row = dict(config=config, us=best_us)
        return dict(name=name, t=t, default=dict(config=(0, 32, True), us=default_us), best=row)

    results = [result("qwen3-8b qkv", 1, 20.0, 15.0, (3, 32, True)),
               result("qwen3-8b down", 2, 30.0, 25.0, (4, 64, True)),
               result("smollm2 o", 1, 10.0, 9.9, (2, 32, True)),      # within 2%: the rule
               result("smollm2 qkv", 8, 10.0, 5.0, (2, 32, False))]   # T > MAX_TOKENS
    text = "{\n" + "\n".join(gemv_sweep.tuned_lines(results)) + "\n}"
    table = eval(text, {"GemvChoice": fused_decode.GemvChoice})  # noqa: S307 (our own output)
    assert table == {("qkv", 6144, 4096, 1): fused_decode.GemvChoice(3, 32, True),
                     ("add", 4096, 12288, 2): fused_decode.GemvChoice(4, 64)}

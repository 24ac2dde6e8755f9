"""Fixtures for the benchmark helpers' CPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def reference_moe_ops(monkeypatch):
    """The MoE ops as kernel/reference.py's numpy/torch references (same contract): the tests
    run a model's forward on the CPU without compiling the MoE kernels."""
    from freetoken.kernel import ops, reference

    for name in ("moe_topk_softmax", "moe_experts", "moe_experts_quant"):
        monkeypatch.setattr(ops, name, getattr(reference, name))

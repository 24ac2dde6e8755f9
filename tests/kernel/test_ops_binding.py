"""One registry per process, and one way to reach a kernel: ops.bind (models) and the ops
wrappers (tests, tools) resolve the same function; a wrapper replaced by a test is honoured."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from freetoken.csrc import build
from freetoken.kernel import loader, ops, reference
from tests.tolerances import assert_close


def test_the_registry_is_loaded_once():
    import freetoken.cli.kernels  # noqa: F401  (every runtime user imported)
    import freetoken.kernel.jit  # noqa: F401

    assert importlib.import_module("freetoken.csrc.registry") is build.registry
    assert sys.modules["freetoken_kernel_registry"] is build.registry
    assert ops.registry is build.registry and loader.build.registry is build.registry
    copies = [m for m in sys.modules.values()
              if getattr(m, "__file__", None) and m.__file__.endswith("kernels/registry.py")]
    assert len({id(m) for m in copies}) == 1


def test_every_registry_function_has_a_wrapper():
    for kernel in build.registry.KERNELS:
        for name in kernel.functions:
            if name in ("quant_matmul_isa",):  # benchmarks reach it through get_function
                continue
            assert callable(getattr(ops, name, None)), f"ops.{name} is missing"
            assert ops.KERNEL_OF[name] in (kernel.name, ops.KERNEL_OF[name])


def test_bind_returns_the_loaded_kernel_function():
    fn = ops.bind("silu_and_mul", "cpu")
    assert fn is loader.get_function("activation", "silu_and_mul", "cpu")
    x, out, want = torch.randn(3, 16), torch.empty(3, 8), torch.empty(3, 8)
    fn(out, x)
    reference.silu_and_mul(want, x)
    assert_close(out, want, torch.float32)


def test_bind_honours_a_replaced_wrapper(monkeypatch):
    monkeypatch.setattr(ops, "silu_and_mul", reference.silu_and_mul)
    assert ops.bind("silu_and_mul", "cpu") is reference.silu_and_mul


def test_bind_names_an_unknown_op():
    with pytest.raises(KeyError, match="no kernel function 'nope'"):
        ops.bind("nope", "cpu")


def test_a_function_the_kernel_does_not_export_is_refused_by_name():
    from freetoken.kernel.errors import KernelUnavailable

    with pytest.raises(KernelUnavailable, match="no function 'quant_matmul' on cpu; it "
                                                 "exports paged_attention, paged_attention_fp8, "
                                                 "set_num_threads"):
        loader.get_function("attention", "quant_matmul", "cpu")

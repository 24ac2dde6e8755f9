"""Device names, dtypes and host arrays as kernel arguments."""

import subprocess
import sys

import numpy as np
import pytest

from freetoken.arrays import (Device, DeviceError, HostArrays, array_view, canonical_dtype,
                              parse_device)


@pytest.mark.parametrize("name,expected", [("cpu", Device("cpu")), ("cuda", Device("cuda")),
                                           ("CUDA:1", Device("cuda", 1)), (" cpu ", Device("cpu"))])
def test_parse_device(name, expected):
    assert parse_device(name) == expected


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cpu:0", "cuda:", "tpu:1", ""])
def test_bad_device_names_are_refused(name):
    with pytest.raises(DeviceError, match="cpu, cuda"):
        parse_device(name)


def test_dtype_names():
    assert [canonical_dtype(n) for n in ("fp32", "BF16", "half", "float16")] == [
        "float32", "bfloat16", "float16", "float16"]
    with pytest.raises(DeviceError, match="int8"):
        canonical_dtype("int8")
    with pytest.raises(DeviceError, match="bfloat16"):
        HostArrays.dtype("bfloat16")


def test_kernel_arguments_share_memory_with_their_arrays():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    column_block = base[:, 2:5]                       # strided rows, as the q/k/v views are
    arg = HostArrays.kernel_arg(column_block)
    assert tuple(arg.shape) == (4, 3)
    view = array_view(arg)
    view[...] = -1
    assert (base[:, 2:5] == -1).all() and (base[:, :2] >= 0).all() and (base[:, 5] >= 0).all()


def test_importing_the_kernel_layer_leaves_torch_unloaded():
    code = ("import sys; from freetoken.arrays import import_tvm_ffi; import_tvm_ffi(); "
            "import freetoken.kernel.loader; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"

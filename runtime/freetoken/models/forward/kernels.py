"""Kernel functions bound once for a device, so the forward's hot loop calls them directly.

``ops`` wrappers look the kernel up on every call (several microseconds each, ~270 calls per
SmolLM2 token); here the same registry function is resolved once. An op that tests replaced
on ``freetoken.kernel.ops`` (e.g. with the plain-torch reference) is used as given.
"""

from __future__ import annotations

from typing import Any, Callable


def bind_op(name: str, device: Any) -> Callable:
    """The function behind ``ops.<name>`` for `device`, with the same arguments."""
    from freetoken.csrc.build import registry  # the one copy the loader uses
    from freetoken.kernel import loader, ops
    from freetoken.kernel.errors import KernelUnavailable

    wrapper = getattr(ops, name)
    if getattr(wrapper, "__module__", None) != ops.__name__:
        return wrapper          # replaced by a test: keep the replacement
    kernel = next((k.name for k in registry.KERNELS
                   if name in k.functions or name in k.cpu_functions), None)
    if kernel is None:
        raise KernelUnavailable(f"no kernel in this build's registry exports {name!r}; this "
                                f"runtime cannot run the model's {name} step")
    return loader.get_function(kernel, name, device)

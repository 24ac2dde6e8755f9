"""Errors raised while finding, checking or building kernels."""


class KernelUnavailable(RuntimeError):
    """A kernel is not in the cache for this device and may not (or cannot) be compiled."""


class KernelCacheError(RuntimeError):
    """The kernel cache is unusable: bad index, version not paired with the runtime, bad sha256."""


class KernelBuildError(RuntimeError):
    """A JIT compile failed; the message carries the compiler's output."""

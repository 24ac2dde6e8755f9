"""Load every kernel a device needs before a model binds them, saying where each comes from.

Start-up reports what really happens: how many kernels load from the cache, how many were
JIT-built earlier, how many must compile now (each one announced as it compiles), and, when
any cannot load at all, one error that names the first and the fix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from freetoken import env as ft_env
from freetoken.kernel.errors import KernelUnavailable
from freetoken.kernel.loader import Resolution, get_module, resolve, unavailable_message
from freetoken.kernel.targets import device_spec


@dataclass(frozen=True)
class KernelPlan:
    """Where each kernel the device needs comes from, decided without compiling anything."""

    resolutions: tuple[Resolution, ...]

    def by_source(self, source: str) -> list[Resolution]:
        return [r for r in self.resolutions if r.source == source]

    def summary(self) -> str:
        cached, earlier = len(self.by_source("cache")), len(self.by_source("jit-cached"))
        compile_now = len(self.by_source("jit"))
        parts = [f"{cached} from the kernel cache"]
        if earlier:
            parts.append(f"{earlier} built earlier by JIT")
        parts.append(f"{compile_now} to compile")
        if self.by_source("unavailable"):
            parts.append(f"{len(self.by_source('unavailable'))} unavailable")
        return f"{len(self.resolutions)} kernels: " + ", ".join(parts)


def plan_kernels(device: Any, env: ft_env.Env | None = None) -> KernelPlan:
    """Every registry kernel built for `device`'s backend and where it would come from."""
    from freetoken.csrc.build import registry

    env = env or ft_env.read()
    spec = device_spec(device)
    rows = [resolve(k.name, spec, env=env, verify=False) for k in registry.KERNELS
            if spec.backend in {registry.backend_of(t) for t in k.targets()}]
    return KernelPlan(tuple(rows))


def load_kernels(device: Any, plan: KernelPlan, say: Callable[[str], None],
                 env: ft_env.Env | None = None) -> None:
    """Load (compiling where the plan says so) every kernel of `plan` for `device`.

    Raises KernelUnavailable (one line naming the first missing kernel, the others and the
    fix) before anything compiles; KernelBuildError when a compile fails.
    """
    env = env or ft_env.read()
    missing = plan.by_source("unavailable")
    if missing:
        others = f" (also {', '.join(r.kernel for r in missing[1:])})" if missing[1:] else ""
        raise KernelUnavailable(f"{len(missing)} of {len(plan.resolutions)} kernels cannot "
                                f"load{others}: {unavailable_message(missing[0], env)}")
    to_compile = plan.by_source("jit")
    for i, res in enumerate(to_compile, 1):
        say(f"compiling kernel {i}/{len(to_compile)}: {res.kernel} for {res.target} "
            f"(once; kept in {env.jit_dir}) ...")
        start = time.perf_counter()
        get_module(res.kernel, device)
        say(f"compiled {res.kernel} in {time.perf_counter() - start:.1f} s")
    for res in plan.resolutions:
        get_module(res.kernel, device)

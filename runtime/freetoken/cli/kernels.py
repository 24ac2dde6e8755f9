"""`ft kernels`: every registry kernel and where it comes from here; `verify` loads them all."""

from __future__ import annotations

import json

import click


def _devices():
    from freetoken.arrays import gpu_available, torch_installed
    from freetoken.kernel.targets import device_spec

    specs = [("cpu", device_spec("cpu"))]
    if torch_installed() and gpu_available():
        specs.append(("cuda", device_spec("cuda")))
    return specs


def sources_line() -> str:
    """Where kernels may come from here: the cache (or why not) and whether JIT may compile."""
    from freetoken import env as ft_env
    from freetoken.kernel.loader import describe_cache

    env = ft_env.read()
    jit = "disabled (FREETOKEN_DISABLE_JIT is set)" if env.disable_jit else f"allowed ({env.jit_dir})"
    return f"kernel cache: {describe_cache(env)}; JIT: {jit}"


def kernel_rows(verify: bool = True) -> list[dict]:
    """One row per (kernel, device backend it is built for) with its resolution."""
    from freetoken.csrc import build
    from freetoken.kernel.loader import resolve

    rows = []
    for kernel in build.registry.KERNELS:
        backends = {build.registry.backend_of(t) for t in kernel.targets()}
        for device, spec in _devices():
            if spec.backend not in backends:
                continue
            res = resolve(kernel.name, spec, verify=verify)
            rows.append({"kernel": kernel.name, "device": device, "status": res.source,
                         "target": res.target, "key": res.key,
                         "path": str(res.path) if res.path else None, "reason": res.reason,
                         "functions": list(kernel.functions_for(spec.backend))})
    return rows


def cache_summary() -> dict:
    """The installed kernel cache: where, which version, and per target the kernels it covers."""
    from freetoken import env as ft_env
    from freetoken.kernel import cache as kcache

    env = ft_env.read()
    root = kcache.locate_cache(env)
    if root is None:
        state = "disabled" if env.disable_kernel_cache else "not installed"
        return {"state": state, "root": None, "version": None, "targets": {}}
    try:
        index = kcache.load_index(root)
    except kcache.KernelCacheError as exc:
        return {"state": f"unusable: {exc}", "root": str(root), "version": None, "targets": {}}
    return {"state": "installed", "root": str(root), "version": index.version,
            "targets": index.coverage()}


STATUS_TEXT = {"cache": "cached ({target})", "jit-cached": "JIT-cached ({target})",
               "jit": "would compile ({target})", "unavailable": "unavailable ({target})"}


@click.group("kernels", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.pass_context
def kernels_command(ctx: click.Context, as_json: bool) -> None:
    """List every kernel of the registry and its status on this machine."""
    if ctx.invoked_subcommand is not None:
        return
    rows, cache = kernel_rows(), cache_summary()
    if as_json:
        click.echo(json.dumps({"kernels": rows, "cache": cache}, indent=1))
        return
    width = max(len(r["kernel"]) for r in rows)
    click.echo(sources_line())
    for r in rows:
        status = STATUS_TEXT[r["status"]].format(target=r["target"])
        click.echo(f"{r['kernel']:<{width}}  {r['device']:<4}  {status}"
                   + (f"  - {r['reason']}" if r["status"] != "cache" and r["reason"] else ""))
    if cache["version"] is None:
        click.echo(f"kernel cache: {cache['state']}")
        return
    click.echo(f"kernel cache {cache['version']} at {cache['root']}:")
    t_width = max((len(t) for t in cache["targets"]), default=0)
    for target, names in cache["targets"].items():
        click.echo(f"  {target:<{t_width}}  {len(names)} kernels: {', '.join(names) or '-'}")


def _verify_row(row: dict) -> str | None:
    """Why this kernel cannot load without compiling, or None once it has loaded."""
    from freetoken.kernel.loader import get_module

    if row["status"] in ("jit", "unavailable"):
        return f"not loadable without compiling: {row['reason'] or 'not in the kernel cache'}"
    try:
        module = get_module(row["kernel"], row["device"])
    except Exception as exc:  # report every kernel, not only the first failure
        return str(exc)
    missing = [f for f in row["functions"] if not hasattr(module, f)]
    return f"missing exported functions {missing}" if missing else None


@kernels_command.command("verify")
def verify_command() -> None:
    """Load every kernel this machine's devices need; fail naming each that would compile."""
    rows = kernel_rows()
    click.echo(sources_line())
    failures = []
    for row in rows:
        problem = _verify_row(row)
        mark = "FAIL" if problem else "ok"
        click.echo(f"{mark:<4}  {row['kernel']:<12} {row['device']:<4} {row['status']:<11} "
                   f"{row['target']}")
        if problem:
            failures.append(f"{row['kernel']} ({row['device']}, {row['target']}): {problem}")
    if failures:
        click.echo("\n".join(["", f"{len(failures)} kernel(s) cannot load:"] + failures), err=True)
        raise click.ClickException(f"{len(failures)} of {len(rows)} kernels cannot load without "
                                   f"compiling; {sources_line()}")
    click.echo(f"all {len(rows)} kernels load without compiling")

"""`ft`: the command group. Subcommands are imported on first use, so `ft --version` is instant.

Every failure ends as one line on stderr and a non-zero exit; `ft --debug ...` (or
FREETOKEN_LOG_LEVEL=debug) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import logging

import click

from freetoken import __version__

# name -> "module:attribute"; the single list of subcommands.
COMMANDS = {
    "serve": "freetoken.cli.serve:serve_command",
    "pull": "freetoken.cli.pull:pull_command",
    "shell": "freetoken.cli.shell:shell_command",
    "ctl": "freetoken.cli.ctl:ctl_command",
    "bench": "freetoken.cli.bench:bench_command",
    "kernels": "freetoken.cli.kernels:kernels_command",
    "doctor": "freetoken.cli.doctor:doctor_command",
}

# Exceptions whose message is written for the user; anything else also names its type.
_OWN_ERRORS = ("freetoken.",)


def one_line(exc: BaseException) -> str:
    """The message of `exc` as a single line (a compiler's output keeps its first lines)."""
    text = " ".join(str(exc).split()) or repr(exc)
    if type(exc).__module__.startswith(_OWN_ERRORS):
        return text
    return f"{type(exc).__name__}: {text}"


def is_debug() -> bool:
    """Whether this `ft` run shows tracebacks (--debug or FREETOKEN_LOG_LEVEL=debug)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and (ctx.find_root().obj or {}).get("debug"))


def configure_logging(level: str) -> None:
    """Configure the `freetoken` loggers once per process (FREETOKEN_LOG_LEVEL or --debug)."""
    logger = logging.getLogger("freetoken")
    if getattr(logger, "_ft_configured", False):
        logger.setLevel(level.upper())
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("freetoken: %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    logger._ft_configured = True  # type: ignore[attr-defined]


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            raise click.ClickException(f"`ft {name}` is not available in this build: {exc}")

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            if is_debug():
                raise
            raise click.ClickException(
                f"{one_line(exc)}  (ft --debug shows the traceback)") from None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="freetoken")
@click.option("--debug", is_flag=True,
              help="Show tracebacks and debug logs (same as FREETOKEN_LOG_LEVEL=debug).")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """FreeToken: serve LLMs through OpenAI- and Anthropic-compatible APIs."""
    from freetoken import env as ft_env

    try:
        level = "debug" if debug else ft_env.read().log_level
    except ft_env.EnvError as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging(level)
    ctx.obj = {"debug": level == "debug", "log_level": level}

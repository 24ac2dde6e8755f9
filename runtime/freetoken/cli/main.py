"""`ft`: the command group. Subcommands are imported on first use, so `ft --version` is instant."""

from __future__ import annotations

import importlib

import click

from freetoken import __version__

# name -> "module:attribute"; the single list of subcommands.
COMMANDS = {
    "serve": "freetoken.cli.serve:serve_command",
    "shell": "freetoken.cli.shell:shell_command",
    "ctl": "freetoken.cli.ctl:ctl_command",
    "bench": "freetoken.cli.bench:bench_command",
    "kernels": "freetoken.cli.kernels:kernels_command",
    "doctor": "freetoken.cli.doctor:doctor_command",
}


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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="freetoken")
def main() -> None:
    """FreeToken: serve LLMs through OpenAI- and Anthropic-compatible APIs."""

"""`ft pull ORG/NAME[:QUANT]`: fetch a model from the Hugging Face Hub into its cache; and the
resolution of every command's --model value (models/resolve.py) with one-line errors."""

from __future__ import annotations

import click


def say(message: str) -> None:
    """A progress line on stderr (stdout carries only the result)."""
    click.echo(f"freetoken: {message}", err=True)


def resolve_model_option(model: str | None) -> tuple[str | None, str | None]:
    """(local path, served name) of a --model value: a path as given, or a Hub repository
    fetched into the Hugging Face cache as needed (its name is then the served id). Errors
    become one-line ClickExceptions (ft --debug shows the traceback)."""
    from freetoken.cli.main import is_debug
    from freetoken.models.errors import ModelError
    from freetoken.models.resolve import resolve_model

    try:
        resolved = resolve_model(model, say)
    except ModelError as exc:
        if is_debug():
            raise
        raise click.ClickException(str(exc)) from None
    return resolved.path, resolved.name


@click.command("pull")
@click.argument("model", metavar="ORG/NAME[:QUANT]")
def pull_command(model: str) -> None:
    """Fetch a model from the Hugging Face Hub (or the mirror HF_ENDPOINT names) into the
    Hugging Face cache (HF_HOME) and print its local path.

    Only the files the loader reads are fetched: config, tokenizer and *.safetensors of a
    safetensors repository; of a GGUF repository the file QUANT picks (default Q4_K_M, else
    Q8_0, else its first model GGUF, as llama.cpp's -hf), every part of a split one. Gated and
    private repositories need HF_TOKEN; HF_HUB_OFFLINE=1 uses the cache only. An existing
    local path is printed as it is."""
    path, _ = resolve_model_option(model)
    click.echo(path)

"""`ft shell`: a terminal chat with a running server, or with a model loaded in-process."""

from __future__ import annotations

import json
from typing import Callable

import click

from freetoken.cli.ctl import DEFAULT_URL

HELP = "Type a message; /reset clears the conversation, /exit (or Ctrl-D) quits."
OnText = Callable[[str], None]


class RemoteChat:
    """Streams replies from a server's /v1/chat/completions."""

    def __init__(self, url: str, api_key: str | None, sampling: dict):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.sampling = sampling

    def reply(self, messages: list[dict], on_text: OnText) -> str:
        from freetoken.cli.ctl import open_url

        body = {"messages": messages, "stream": True, **self.sampling}
        pieces = []
        with open_url(self.url, "/v1/chat/completions", self.api_key, None, body) as response:
            if response.status != 200:
                detail = json.loads(response.read()).get("error", {}).get("message")
                raise click.ClickException(f"the server answered {response.status}: {detail}")
            for raw in response:
                text = _delta_text(raw.decode("utf-8").rstrip("\r\n"))
                if text:
                    pieces.append(text)
                    on_text(text)
        return "".join(pieces)


def _delta_text(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    chunk = json.loads(line[6:])
    if "error" in chunk:
        raise click.ClickException(chunk["error"].get("message", "generation failed"))
    choices = chunk.get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


class LocalChat:
    """Runs the engine in this process."""

    def __init__(self, model_path: str | None, device: str, sampling: dict):
        from freetoken.cli.serve import load_engine
        from freetoken.engine.config import EngineConfig

        self.loaded, self.engine = load_engine(model_path, "auto", EngineConfig(device=device))
        self.sampling = sampling

    def reply(self, messages: list[dict], on_text: OnText) -> str:
        import asyncio

        from freetoken.engine.request import SamplingParams

        tokenizer = self.loaded.tokenizer
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages),
                                  add_special_tokens=False)
        params = SamplingParams(**self.sampling)

        async def run() -> str:
            pieces = []
            async for output in self.engine.generate(prompt, params):
                if output.finish_reason == "error":
                    raise click.ClickException(f"generation failed: {output.error}")
                if output.text:
                    pieces.append(output.text)
                    on_text(output.text)
            return "".join(pieces)

        return asyncio.run(run())

    def close(self) -> None:
        self.engine.shutdown()


@click.command("shell")
@click.option("--url", default=None, help=f"Chat with this server (default {DEFAULT_URL}).")
@click.option("--model", "model_path", default=None, metavar="MODEL",
              help="Load this model in-process instead of using a server: a path, or a "
                   "Hugging Face repository ORG/NAME[:QUANT] (as `ft serve --model`).")
@click.option("--local", is_flag=True, help="Load the default model in-process.")
@click.option("--device", default="auto", show_default=True,
              type=click.Choice(["auto", "cpu", "cuda"]), help="For --model/--local.")
@click.option("--api-key", default=None, help="The server's --api-key, if any.")
@click.option("--system", default=None, help="A system prompt.")
@click.option("--temperature", type=click.FloatRange(0), default=None)
@click.option("--max-tokens", type=click.IntRange(1), default=None)
def shell_command(url, model_path, local, device, api_key, system, temperature,
                  max_tokens) -> None:
    """Chat in the terminal; replies stream as they are generated."""
    if url and (model_path or local):
        raise click.UsageError("use either --url or --model/--local, not both")
    sampling = {k: v for k, v in (("temperature", temperature), ("max_tokens", max_tokens))
                if v is not None}
    if model_path or local:
        from freetoken.cli.pull import resolve_model_option

        chat = LocalChat(resolve_model_option(model_path)[0], device, sampling)
    else:
        chat = RemoteChat(url or DEFAULT_URL, api_key, sampling)
    try:
        chat_loop(chat, system)
    finally:
        if isinstance(chat, LocalChat):
            chat.close()


def chat_loop(chat, system: str | None) -> None:
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    click.echo(HELP)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            click.echo()
            return
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history = list(base)
            click.echo("(conversation cleared)")
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        click.echo("assistant> ", nl=False)
        text = chat.reply(history, lambda piece: click.echo(piece, nl=False))
        click.echo()
        history.append({"role": "assistant", "content": text})

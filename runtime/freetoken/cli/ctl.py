"""`ft ctl`: ask a running server for its health or its statistics."""

from __future__ import annotations

import json

import click

from freetoken.server.config import ServerConfig

DEFAULT_URL = ServerConfig().url


def fetch_json(url: str, path: str, api_key: str | None, timeout: float = 10.0):
    """(status, JSON body) of GET url+path; unreachable servers raise a ClickException."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + path, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise click.ClickException(
            f"cannot reach a FreeToken server at {url} ({exc.__class__.__name__}: {exc}); "
            "is `ft serve` running there? Pass --url to point elsewhere.") from None
    try:
        return response.status_code, response.json()
    except ValueError:
        raise click.ClickException(f"{url}{path} answered {response.status_code} with a body "
                                   "that is not JSON; is this a FreeToken server?") from None


url_option = click.option("--url", default=DEFAULT_URL, show_default=True,
                          help="Base URL of the server.")
key_option = click.option("--api-key", default=None, help="The server's --api-key, if any.")


@click.group("ctl")
def ctl_command() -> None:
    """Query a running FreeToken server."""


@ctl_command.command("health")
@url_option
def health_command(url: str) -> None:
    """Exit 0 when the server and its engine are up."""
    status, body = fetch_json(url, "/health", None)
    if status != 200:
        raise click.ClickException(f"{url} is unhealthy ({status}): {json.dumps(body)}")
    click.echo(f"ok: {body.get('model')} at {url}")


@ctl_command.command("stats")
@url_option
@key_option
def stats_command(url: str, api_key: str | None) -> None:
    """Print /v1/stats as JSON (running/waiting requests, KV pages, sampling defaults)."""
    status, body = fetch_json(url, "/v1/stats", api_key)
    if status != 200:
        message = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
        raise click.ClickException(f"{url}/v1/stats answered {status}: {message}")
    click.echo(json.dumps(body, indent=2))

"""`ft ctl`: ask a running server for its health or its statistics (stdlib HTTP only)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import click

from freetoken.server.config import ServerConfig

DEFAULT_URL = ServerConfig().url


class Unreachable(click.ClickException):
    """No server answered at the URL."""


def open_url(url: str, path: str, api_key: str | None, timeout: float | None,
             body: dict | None = None):
    """The HTTP response to GET (or POST `body` as JSON); an HTTP error status is returned as
    a response too, and an unreachable server raises Unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"cannot reach a FreeToken server at {url} ({reason}); is `ft serve` "
                          "running there? Pass --url to point elsewhere.") from None


def fetch_json(url: str, path: str, api_key: str | None, timeout: float = 10.0):
    """(status, JSON body) of GET url+path; unreachable servers raise a ClickException."""
    with open_url(url, path, api_key, timeout) as response:
        status, raw = response.status, response.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        raise click.ClickException(f"{url}{path} answered {status} with a body that is not "
                                   "JSON; is this a FreeToken server?") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child that exited but was not reaped yet (the shell reaps it later) is a zombie.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _runs_under(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants (a server started through
    a wrapper such as `timeout`); True where /proc cannot tell."""
    for _ in range(64):
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return True
        if pid <= 1:
            return False
    return False


def wait_for_health(url: str, wait: float, pid: int | None) -> tuple[int, dict]:
    """Poll /health until it answers 200, `wait` seconds pass, or process `pid` exits. With
    `pid`, only an answer from that process (or one it started) counts: another server already
    on the port does not make a server that failed to bind look ready."""
    deadline = time.monotonic() + wait
    other = None  # the pid of another server answering at `url`
    while True:
        try:
            status, body = fetch_json(url, "/health", None, timeout=5.0)
            answered = body.get("pid") if isinstance(body, dict) else None
            if (pid is not None and isinstance(answered, int)
                    and not _runs_under(answered, pid)):
                other = answered
            elif status == 200 or time.monotonic() >= deadline:
                return status, body
        except Unreachable:
            if time.monotonic() >= deadline:
                raise
        also = f" (another server, pid {other}, answers at {url})" if other else ""
        if pid is not None and not _alive(pid):
            raise click.ClickException(f"the server (pid {pid}) exited before it was ready; "
                                       f"its reason is printed above{also}")
        if other is not None and time.monotonic() >= deadline:
            raise click.ClickException(f"the server (pid {pid}) is not ready after {wait:g} s"
                                       f"{also}")
        time.sleep(0.2)


url_option = click.option("--url", default=DEFAULT_URL, show_default=True,
                          help="Base URL of the server.")
key_option = click.option("--api-key", default=None, help="The server's --api-key, if any.")


@click.group("ctl")
def ctl_command() -> None:
    """Query a running FreeToken server."""


@ctl_command.command("health")
@url_option
@click.option("--wait", default=0.0, type=click.FloatRange(0), metavar="SECONDS",
              help="Keep asking until the server is ready, up to SECONDS.")
@click.option("--pid", default=None, type=int,
              help="With --wait: stop waiting as soon as this process (the server) exits.")
def health_command(url: str, wait: float, pid: int | None) -> None:
    """Exit 0 when the server and its engine are up."""
    status, body = wait_for_health(url, wait, pid)
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


@ctl_command.command("cache")
@url_option
@key_option
@click.option("--kv", default=None, type=click.IntRange(1), metavar="TOKENS",
              help="New KV pool size in tokens.")
@click.option("--moe", default=None, type=click.FloatRange(0.0, 1.0, min_open=True),
              metavar="RATE", help="New expert cache rate (0 < RATE <= 1).")
@click.option("--states", default=None, type=click.IntRange(1), metavar="SLOTS",
              help="New recurrent-state pool size in slots (hybrid models; at most "
                   "--max-num-seqs, it caps the sequences run at once).")
@click.option("--wait", default=0.0, type=click.FloatRange(0, 3600), metavar="SECONDS",
              help="Wait up to SECONDS for requests holding KV pages or state slots past a "
                   "shrunk pool.")
def cache_command(url: str, api_key: str | None, kv: int | None, moe: float | None,
                  states: int | None, wait: float) -> None:
    """Resize the KV pool, the expert cache and/or the recurrent-state pool of a running
    server, without reloading. A plan that does not fit is refused with the numbers; the old
    pools keep serving."""
    if kv is None and moe is None and states is None:
        raise click.UsageError("pass --kv TOKENS, --moe RATE and/or --states SLOTS")
    body = {k: v for k, v in (("kv", kv), ("moe", moe), ("states", states)) if v is not None}
    body["wait"] = wait
    with open_url(url, "/v1/cache", api_key, timeout=wait + 600.0, body=body) as response:
        status, raw = response.status, response.read()
    try:
        reply = json.loads(raw)
    except ValueError:
        raise click.ClickException(f"{url}/v1/cache answered {status} with a body that is not "
                                   "JSON; is this a FreeToken server?") from None
    if status != 200:
        message = reply.get("error", {}).get("message", reply) if isinstance(reply, dict) \
            else reply
        raise click.ClickException(f"resize refused ({status}): {message}")
    keys = ("kv_pool_tokens", "kv_pool_bytes", "moe_cache_rate", "expert_cache_slots",
            "expert_pool_bytes", "vram_allocated_bytes", "state_slots_total",
            "state_bytes_total")
    click.echo(json.dumps({k: reply.get(k) for k in keys if k in reply}, indent=2))

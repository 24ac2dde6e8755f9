"""`ft pull` and `ft serve --model ORG/NAME[:QUANT]` against the stand-in hub: the path on
stdout, progress on stderr, and each failure as one `Error:` line with a non-zero exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from freetoken.cli.main import main
from tests.models.hub_repos import (GATED, GGUF, GPT2, GPT2_GGUF, HF_VARIABLES, build_repos,
                                    closed_port_url, huggingface_env, start_stand_in)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    return build_repos(tmp_path_factory.mktemp("hub-repos"))


@pytest.fixture
def hub(repos, tmp_path):
    stand_in = start_stand_in(repos)
    with huggingface_env(HF_ENDPOINT=stand_in.url, HF_HOME=str(tmp_path / "hf-home")):
        yield stand_in
    stand_in.close()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_pull_prints_the_path_and_reports_progress_on_stderr(hub):
    result = CliRunner().invoke(main, ["pull", GGUF + ":Q8_0"])
    assert result.exit_code == 0, result.output
    path = Path(result.stdout.strip())
    assert path.name == "tiny-llama-Q8_0.gguf" and path.is_file()
    assert re.search(rf"freetoken: fetching {GGUF}/tiny-llama-Q8_0.gguf \(183.8 kB\)\n",
                     result.stderr)
    assert "100%" in result.stderr                     # huggingface_hub's bar, not a terminal
    assert "fetched 1 file(s)" in result.stderr
    again = CliRunner().invoke(main, ["pull", GGUF + ":Q8_0"])   # cached: no download
    assert again.stdout == result.stdout and "in the Hugging Face cache" in again.stderr
    assert hub.whole_file_gets(GGUF) == ["tiny-llama-Q8_0.gguf"]


@pytest.mark.parametrize("name, token, fragment", [
    ("stand-in/nope", None, "no model repository stand-in/nope on http://127.0.0.1:"),
    (GATED, None, f"{GATED}: a gated repository; accept its conditions at "),
    (GATED, "hf_wrong", "the token in use (HF_TOKEN or `hf auth login`) has no access"),
    (GPT2, None, "architecture 'GPT2LMHeadModel' is not supported; supported: "),
    (GPT2_GGUF, None, "architecture 'gpt2' is not supported; supported: "),
    (GGUF + ":Q3_K_S", None, "has no GGUF of type Q3_K_S; it has Q4_K_M, Q8_0"),
])
def test_pull_failures_are_one_line(hub, monkeypatch, name, token, fragment):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    result = CliRunner().invoke(main, ["pull", name])
    errors = error_lines(result.stderr)
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert fragment in errors[0] and result.stdout == ""
    assert "Traceback" not in result.output


def test_pull_without_a_network_is_one_line(tmp_path):
    with huggingface_env(HF_ENDPOINT=closed_port_url(), HF_HOME=str(tmp_path)):
        result = CliRunner().invoke(main, ["pull", GGUF])
    errors = error_lines(result.stderr)
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert "cannot reach http://127.0.0.1:" in errors[0] and "HF_ENDPOINT" in errors[0]


def test_serve_model_by_name_serves_the_fetched_file_under_that_name(hub, monkeypatch):
    from freetoken.cli import serve

    started = []
    monkeypatch.setattr(serve, "run_server", lambda path, dtype, engine, server, *rest:
                        started.append((path, server.served_model_name)))
    result = CliRunner().invoke(main, ["serve", "--model", GGUF + ":Q8_0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    path, name = started[0]
    assert Path(path).name == "tiny-llama-Q8_0.gguf" and name == GGUF + ":Q8_0"
    result = CliRunner().invoke(main, ["serve", "--model", GGUF, "--device", "cpu",
                                       "--served-model-name", "tiny"])
    assert result.exit_code == 0, result.output
    assert Path(started[1][0]).name == "tiny-llama-Q4_K_M.gguf" and started[1][1] == "tiny"


def ft(*args: str, env: dict) -> subprocess.CompletedProcess:
    """`ft ...` in a new process with exactly `env`'s Hugging Face variables."""
    base = {k: v for k, v in os.environ.items() if k not in HF_VARIABLES}
    return subprocess.run([sys.executable, "-c", "from freetoken.cli.main import main; main()",
                           *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=300)


def test_pull_reads_the_hugging_face_variables_of_its_process(repos, tmp_path):
    hub = start_stand_in(repos)
    home = {"HF_HOME": str(tmp_path / "home")}
    try:
        online = ft("pull", GGUF + ":Q8_0", env={"HF_ENDPOINT": hub.url, **home})
    finally:
        hub.close()
    assert online.returncode == 0, online.stderr
    path = online.stdout.strip()
    assert path.startswith(str(tmp_path / "home" / "hub")) and Path(path).is_file()
    offline = {"HF_ENDPOINT": closed_port_url(), "HF_HUB_OFFLINE": "1", **home}
    cached = ft("pull", GGUF + ":Q8_0", env=offline)
    assert cached.returncode == 0 and cached.stdout.strip() == path, cached.stderr
    missing = ft("pull", GPT2, env=offline)
    assert missing.returncode == 1 and len(error_lines(missing.stderr)) == 1, missing.stderr
    assert "not in the Hugging Face cache and HF_HUB_OFFLINE=1" in missing.stderr

"""The manifest: the pinned engine-manifest.json, the schema, and ci/write_manifest.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.install.conftest import REPO
from tests.install.wheels import fake_pair, load_ci, manifest_for

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency: "
                                 "pip install -e '.[test]'")
SCHEMA = json.loads((REPO / "ci" / "manifest.schema.json").read_text())
COMMIT = "0123456ab"


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_pinned_manifest_matches_the_schema():
    pinned = json.loads((REPO / "engine-manifest.json").read_text())
    jsonschema.validate(pinned, SCHEMA)


def test_pinned_manifest_pins_a_clean_pair_of_this_history():
    pinned = json.loads((REPO / "engine-manifest.json").read_text())
    load_ci("fetch_pair").check_names(pinned)  # names, version and stamps agree
    assert ".dirty" not in pinned["version"], "pin a build of a committed tree, not --allow-dirty"
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: cannot look the pinned commit up")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                      capture_output=True, text=True).stdout.strip() == "true":
        pytest.skip("shallow clone: the pinned commit may be outside the fetched history")
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{pinned['commit']}^{{commit}}"],
                           capture_output=True)
    assert found.returncode == 0, f"engine-manifest.json pins commit {pinned['commit']}, not in this history"


def test_pinned_manifest_points_at_the_release_location():
    """Installable from a checkout: absolute URLs where ci/nightly.sh publishes that commit."""
    from freetoken.env import RELEASE_URL

    pinned = json.loads((REPO / "engine-manifest.json").read_text())
    for key in ("runtime", "kernel_cache"):
        entry = pinned[key]
        assert entry["url"] == f"{RELEASE_URL}/nightly-{pinned['commit']}/{entry['name']}"


@pytest.fixture
def fake_manifest(tmp_path) -> dict:
    runtime, cache = fake_pair(tmp_path, COMMIT)
    return manifest_for(runtime, cache, COMMIT)


MUTATIONS = {
    "missing sha256": lambda m: m["runtime"].pop("sha256"),
    "short sha256": lambda m: m["kernel_cache"].update(sha256="ab" * 20),
    "zero size": lambda m: m["runtime"].update(size=0),
    "schema 2": lambda m: m.update(schema=2),
    "other platform": lambda m: m.update(platform="win_amd64"),
    "commit not hex": lambda m: m.update(commit="HEAD"),
    "not a wheel": lambda m: m["runtime"].update(name="freetoken.tar.gz"),
}


def test_fake_manifest_is_valid(fake_manifest):
    jsonschema.validate(fake_manifest, SCHEMA)
    load_ci("fetch_pair").check_fields(fake_manifest, "test")


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_schema_and_fetch_reject_the_same_damage(fake_manifest, mutation):
    bad = copy.deepcopy(fake_manifest)
    MUTATIONS[mutation](bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)
    with pytest.raises(load_ci("wheel_pair").PairError):
        load_ci("fetch_pair").check_fields(bad, "test")


def test_schema_rejects_unknown_fields(fake_manifest):
    bad = copy.deepcopy(fake_manifest)
    bad["kernel_cache"]["sha265"] = bad["kernel_cache"]["sha256"]
    with pytest.raises(jsonschema.ValidationError, match="sha265"):
        jsonschema.validate(bad, SCHEMA)


def test_writer_reads_cuda_from_the_cache_index(tmp_path):
    runtime, cache = fake_pair(tmp_path, COMMIT, cuda="13.0")
    manifest = load_ci("write_manifest").build_manifest(runtime, cache, COMMIT)
    assert manifest["cuda"] == "13.0"  # the index says 13.0.88
    jsonschema.validate(manifest, SCHEMA)


def test_writer_refuses_mismatched_stamps(tmp_path):
    runtime, _ = fake_pair(tmp_path, COMMIT)
    _, cache = fake_pair(tmp_path / "other", COMMIT, cache_commit="fedcba987")
    out = tmp_path / "m.json"
    result = subprocess.run([sys.executable, str(REPO / "ci" / "write_manifest.py"), "--runtime",
                             str(runtime), "--kernel-cache", str(cache), "--commit", COMMIT,
                             "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 1 and "error: stamps do not match" in result.stderr
    assert not out.exists()


def test_writer_cli_writes_next_to_the_runtime(tmp_path):
    runtime, cache = fake_pair(tmp_path, COMMIT)
    result = subprocess.run([sys.executable, str(REPO / "ci" / "write_manifest.py"), "--runtime",
                             str(runtime), "--kernel-cache", str(cache), "--commit", COMMIT],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "engine-linux_x86_64.json").read_text())
    assert written["runtime"]["url"] == runtime.name and written["version"] == f"0.1.0+g{COMMIT}"
    jsonschema.validate(written, SCHEMA)

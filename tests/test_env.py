"""The typed environment module: parsing, errors, and the docs table kept complete."""

import pytest

from freetoken import env
from tests.conftest import REPO


def test_every_variable_is_documented_in_the_environment_page():
    page = (REPO / "docs" / "environment.md").read_text()
    for name in env.VARIABLES:
        assert f"`{name}`" in page, name


@pytest.mark.parametrize("raw, expected", [("1", True), ("yes", True), ("TRUE", True),
                                           ("0", False), ("no", False), ("", False)])
def test_booleans(raw, expected):
    assert env.read({"FREETOKEN_DISABLE_JIT": raw}).disable_jit is expected


@pytest.mark.parametrize("name, raw", [("FREETOKEN_DISABLE_JIT", "maybe"),
                                       ("FREETOKEN_BUILD_JOBS", "two"),
                                       ("FREETOKEN_NUM_THREADS", "-1"),
                                       ("FREETOKEN_LOG_LEVEL", "loud")])
def test_bad_values_name_the_variable(name, raw):
    with pytest.raises(env.EnvError, match=name):
        env.read({name: raw})


def test_defaults_and_lists(tmp_path):
    e = env.read({"FREETOKEN_CACHE_ROOT": str(tmp_path), "FREETOKEN_CACHE_TARGETS": "cpu, sm_90a;gfx1201"})
    assert e.jit_dir == tmp_path / "jit" and not e.disable_jit
    assert e.cache_targets == ("cpu", "sm_90a", "gfx1201")

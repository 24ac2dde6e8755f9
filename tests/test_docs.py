"""The README and docs/ checked against the repository: every relative link and heading anchor
resolves, every `ft` command and flag they name exists in the CLI, every script and repository
path they name exists (and takes the flags given), every FREETOKEN_* variable is declared in
env.py and documented, and the quickstart is what CI runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

from freetoken import env
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SEPARATORS = {"&&", "||", "|", ";", "&"}
# Top folders whose paths the docs name, and the packages of runtime/freetoken/ they name bare.
TOP = ("ci", ".ci", "benchmarks", "docs", "kernels", "kernel-cache", "runtime", "tests",
       "toolchain")
PACKAGES = tuple(p.name for p in (REPO / "runtime" / "freetoken").iterdir() if p.is_dir())
IGNORED = ("kernel-cache/build/",)  # git-ignored build output, absent from a clone
EXTERNAL_FLAGS = {"--ulimit"}       # docker's, named in the memlock fix


@dataclass
class Doc:
    path: Path
    prose: str        # the text outside fenced blocks
    blocks: list[str]
    spans: list[str]  # inline code spans of the prose


def read(path: Path) -> Doc:
    text = path.read_text()
    blocks = [m.group(1) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return Doc(path, prose, blocks, [m.group(2) for m in SPAN.finditer(prose)])


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return [read(p) for p in DOCS]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    found, counts = set(), {}
    for line in doc.prose.splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            found.add(f"{base}-{counts[base]}" if base in counts else base)
            counts[base] = counts.get(base, 0) + 1
    return found


def test_every_relative_link_resolves(docs):
    by_path = {d.path: d for d in docs}
    broken = []
    for doc in docs:
        for target in LINK.findall(SPAN.sub("", doc.prose)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (doc.path.parent / path).resolve() if path else doc.path
            if not dest.exists():
                broken.append(f"{doc.path.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(by_path.get(dest) or read(dest)):
                broken.append(f"{doc.path.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_page_starts_from_the_command_a_user_runs(docs):
    """Each docs/ page: its title, then a code block."""
    late = [d.path.name for d in docs[1:]
            if not re.match(r"# .+\n+```", d.path.read_text())]
    assert not late, late


# --- code: `ft` invocations, scripts and their flags, paths -------------------------------------

@dataclass
class Command:
    options: set[str]
    children: dict[str, "Command"] = field(default_factory=dict)


def command_tree(cmd: click.Command, ctx: click.Context) -> Command:
    opts = {"--help", "-h"} | {o for p in cmd.params if isinstance(p, click.Option)
                               for o in p.opts + p.secondary_opts}
    node = Command(opts)
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            node.children[name] = command_tree(cmd.get_command(ctx, name), ctx)
    return node


@pytest.fixture(scope="module")
def ft_tree() -> Command:
    from freetoken.cli.main import main

    return command_tree(main, click.Context(main))


def words(code: str, block: bool) -> list[str]:
    """Shell-ish words of a code snippet; quotes, brackets of substitutions, newlines and
    comments become separators, so `$(ft pull X)` and `{ ft serve & }` read as commands."""
    if block:
        code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in code.splitlines())
    code = code.replace("\\\n", " ")
    for ch in "\"'(){}`\n":
        code = code.replace(ch, " ; ")
    return code.split()


def flags(token: str) -> list[str]:
    """`--a/--b` -> both; `--a=x` -> --a; `[--a]` -> --a."""
    token = token.strip("[]").split("=")[0]
    return [f for f in token.split("/") if f.startswith("-")] if token not in ("-", "--") else []


def ft_problems(tokens: list[str], tree: Command) -> list[str]:
    node, path, problems = tree, ["ft"], []
    for tok in tokens:
        if tok in SEPARATORS or tok.startswith(">"):
            break
        tok = tok.strip("[]")
        if tok.startswith("-"):
            problems += [f"{' '.join(path)} {f}" for f in flags(tok) if f not in node.options]
        elif node.children:
            names = tok.split("|")
            if not all(n in node.children for n in names):
                if not tok.isupper():  # COMMAND: a placeholder
                    problems.append(f"{' '.join(path)} {tok} (no such command)")
                break
            if len(names) > 1:
                break
            node = node.children[tok]
            path.append(tok)
    return problems


def script_of(tokens: list[str], i: int) -> Path | None:
    """The repository script token i names: ci/x.sh, benchmarks/x.py, -m benchmarks.x."""
    tok = tokens[i]
    if i > 0 and tokens[i - 1] == "-m" and tok.startswith("benchmarks."):
        base = REPO / tok.replace(".", "/")
        return base if base.is_dir() else base.with_suffix(".py")
    if re.fullmatch(r"(\./)?(ci|benchmarks|\.ci)/[\w./-]+\.(sh|py)|\.ci/run", tok):
        return REPO / tok
    return None


def script_problems(tokens: list[str], i: int, script: Path) -> list[str]:
    if not script.exists():
        return [f"{tokens[i]} (no such script)"]
    files = sorted(script.rglob("*.py")) if script.is_dir() else [script]
    source = "".join(f.read_text() for f in files)
    problems = []
    for tok in tokens[i + 1:]:
        if tok in SEPARATORS:
            break
        for f in flags(tok) if tok.lstrip("[").startswith("-") else []:
            if not re.search(re.escape(f) + r"(?![\w-])", source):
                problems.append(f"{tokens[i]} {f} (not in the script)")
    return problems


def path_problem(tok: str) -> str | None:
    tok = tok.rstrip(".,;:")
    if any(c in tok for c in "<>$~") or tok.startswith(IGNORED):
        return None
    if re.fullmatch(r"[\w.-]+\.(log|txt)|(h100|h200|cpu|gemma3)-[\w.-]+\.json", tok):
        where = REPO / "benchmarks" / "results"       # a log named bare
    elif tok.split("/")[0] in TOP and "/" in tok:
        where = REPO
    elif tok.split("/")[0] in PACKAGES and "/" in tok:
        where = REPO / "runtime" / "freetoken"          # models/resolve.py and the like
    else:
        return None
    return None if list(where.glob(tok.rstrip("/"))) else f"{tok} (no such path)"


def code_problems(doc: Doc, tree: Command) -> list[str]:
    problems = []
    for code, block in [(b, True) for b in doc.blocks] + [(s, False) for s in doc.spans]:
        tokens = words(code, block)
        for i, tok in enumerate(tokens):
            if tok == "ft" or tok.endswith("/ft"):
                problems += ft_problems(tokens[i + 1:], tree)
            elif script := script_of(tokens, i):
                problems += script_problems(tokens, i, script)
            elif problem := path_problem(tok):
                problems.append(problem)
    return [f"{doc.path.name}: {p}" for p in problems]


def test_every_ft_command_flag_script_and_path_exists(docs, ft_tree):
    problems = [p for doc in docs for p in code_problems(doc, ft_tree)]
    assert not problems, problems


def all_options(node: Command) -> set[str]:
    return node.options.union(*(all_options(c) for c in node.children.values()))


def test_every_bare_flag_belongs_to_ft_or_a_named_script(docs, ft_tree):
    """A flag named alone (`--max-num-seqs`) is an `ft` option, or one of the repository's
    scripts takes it (`--manifest`, `--shapes`)."""
    known = all_options(ft_tree) | EXTERNAL_FLAGS
    sources = "".join(p.read_text() for pattern in ("ci/*", "benchmarks/**/*.py",
                                                    "benchmarks/*.sh") for p in REPO.glob(pattern)
                      if p.is_file())
    unknown = [f"{doc.path.name}: {f}" for doc in docs for span in doc.spans
               if span.startswith("--") for f in flags(span.split()[0])
               if f not in known and not re.search(re.escape(f) + r"(?![\w-])", sources)]
    assert not unknown, unknown


# --- environment variables ----------------------------------------------------------------------

def test_every_variable_named_exists_and_every_variable_is_documented(docs):
    named = {v for doc in docs for v in re.findall(r"FREETOKEN_[A-Z0-9_]+", doc.path.read_text())}
    assert named - set(env.VARIABLES) == set(), "named in the docs but not in env.VARIABLES"
    page = (REPO / "docs" / "environment.md").read_text()
    assert [v for v in env.VARIABLES if f"`{v}`" not in page] == []


# --- the quickstart -----------------------------------------------------------------------------

def readme_block(after: str) -> str:
    text = (REPO / "README.md").read_text()
    return FENCE.search(text, text.index(after)).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = readme_block("Set up and run the tests")
    assert command == "bash ci/test.sh"
    ci_run = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert f"exec {command}" in ci_run or command in ci_run


def cpu_quickstart() -> tuple[str, str]:
    """(install, serve-and-ask) halves of the README's first command."""
    command = readme_block("Serve the embedded default model").replace("\\\n", " ")
    install, _, serve = command.partition("&& {")
    return install.strip(), "{" + serve


def test_the_cpu_quickstart_installs_this_checkout_with_its_cpu_cache():
    install, serve = cpu_quickstart()
    assert install.split() == ["python3", "-m", "venv", ".venv", "&&",
                               "FREETOKEN_CACHE_TARGETS=cpu", ".venv/bin/pip", "install", ".",
                               "./kernel-cache"]
    assert "ft serve &" in serve and "ft ctl health --wait" in serve and "curl" in serve


@pytest.mark.slow
@pytest.mark.needs_weights
def test_the_cpu_quickstart_serves_and_answers():
    """The quickstart after its install step, as written, with this interpreter's `ft`: the
    install is what ci/test.sh has already done (this checkout and a kernel cache)."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ft").exists() or shutil.which("curl") is None:
        pytest.skip("needs this environment's `ft` script and curl")
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 1919)) == 0:
            pytest.skip("port 1919 is taken; the quickstart serves there")
    script = (cpu_quickstart()[1].replace(".venv/bin/", f"{bin_dir}/")
              + "\nrc=$?; kill $! 2>/dev/null; wait $! 2>/dev/null; exit $rc\n")
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, start_new_session=True, env=dict(os.environ))
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    replies = [r for r in (_json_at(out, i) for i in range(len(out)) if out[i] == "{")
               if isinstance(r, dict) and "choices" in r]
    assert replies, out[-2000:]
    assert "Paris" in replies[-1]["choices"][0]["message"]["content"], replies[-1]


def _json_at(text: str, i: int):
    try:
        return json.JSONDecoder().raw_decode(text, i)[0]
    except ValueError:
        return None

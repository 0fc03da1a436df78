"""The front door runs as written: every command, make target, job file and link the README (and the docs/ pages it
links) shows exists, and each job file it names loads and passes `batchjson check`. No engine starts."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchjson.cli import main
from batchjson.spec import load_spec
from bench.__main__ import COMMANDS as BENCH_COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _code(page: Path) -> list[str]:
    """The page's code: fenced blocks other than Python's and TOML's, and inline code spans, one string each."""
    text = page.read_text()
    blocks = re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M))
    return [body for lang, body in blocks if lang not in ("python", "toml")] + spans


def _invocations(page: Path) -> list[tuple[str, list[str]]]:
    """Each `batchjson SUBCOMMAND ...` the page shows, with the words after it (up to a comment or the line's end)."""
    found = []
    for code in _code(page):
        for line in code.splitlines():
            for m in re.finditer(r"(?:^|[\s/])batchjson ([a-z][\w-]*)([^#|`]*)", line):
                found.append((m.group(1), m.group(2).split()))
    return found


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_its_first_commands_are_the_two():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    first = re.search(r"^```\n(.*?)^```", text, re.S | re.M).group(1).splitlines()
    assert [line.split()[:2] for line in first] == [["make", "run"], ["make", "test"]]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_batchjson_command_shown_is_a_real_command_with_real_options(page):
    shown = _invocations(page)
    assert shown or page.name not in ("README.md", "operations.md")
    for name, words in shown:
        command = main.commands.get(name)
        assert isinstance(command, click.Command), f"{page.name}: `batchjson {name}` is no command"
        options = {o for p in command.params for o in getattr(p, "opts", []) if o.startswith("-")}
        for word in words:
            flag = word.strip("[]()").split("=")[0]
            if flag.startswith("--"):
                assert flag in options, f"{page.name}: `batchjson {name}` has no option {flag}"


def test_each_make_target_shown_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    shown = {t for code in _code(README) for t in re.findall(r"\bmake ([\w-]+)", code)}
    shown |= set(re.findall(r"`make ([\w-]+)`", README.read_text()))
    assert {"run", "test"} <= shown and shown <= targets, shown - targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_file_a_page_names_exists(page):
    text = page.read_text()
    names = set(re.findall(r"(?<![\w/.])((?:jobs|sample_data|bench|tests|batchjson|docs)/[\w./-]+\.(?:toml|py|json|parquet|md|sh))",
                           text))
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_each_job_file_the_readme_names_loads_and_checks_without_an_engine():
    jobs = sorted(set(re.findall(r"\bjobs/[\w-]+\.toml", README.read_text())))
    assert "jobs/minimal.toml" in jobs and "jobs/sample.toml" in jobs
    for job in jobs:
        load_spec(ROOT / job)
        result = CliRunner().invoke(main, ["check", str(ROOT / job)])
        assert result.exit_code == 0, f"batchjson check {job}:\n{result.output}"
        assert "pass1 grammar: xgrammar" in result.output


def test_the_minimal_job_shown_is_the_file():
    shown = README.read_text().split("This is `jobs/minimal.toml`")[1].split("```toml\n")[1].split("```")[0]
    body = "\n".join(line for line in (ROOT / "jobs" / "minimal.toml").read_text().splitlines()
                     if not line.startswith("#")).strip()
    assert shown.strip() == body


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_link_resolves_to_a_file_and_a_heading(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link {target} names no file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: link {target} names no heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_bench_subcommand_shown_exists(page):
    for name in re.findall(r"python -m bench ([a-z][\w-]*)", page.read_text()):
        assert name in BENCH_COMMANDS, f"{page.name}: `python -m bench {name}` is no subcommand"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README.read_text()))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}


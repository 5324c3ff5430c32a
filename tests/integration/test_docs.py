"""The way in stays short and true: README within 16 KB, every command documented once, docs links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import typer

from cli import app

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _commands() -> set[str]:
    group = typer.main.get_command(app)
    return set(group.list_commands(group.context_class(group, info_name="oracle")))


def test_readme_is_at_most_16_kb():
    """README.md holds what a newcomer needs first; reference and measurements live in docs/ and benchmarks/."""
    assert len(README.encode()) <= 16 * 1024, len(README.encode())


def test_readme_command_table_lists_every_command_of_the_app_once():
    """README's Commands table names exactly the typer app's commands, each in one row."""
    section = README.split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `oracle ([a-z-]+)` \|", section, flags=re.M)
    assert sorted(rows) == sorted(_commands()), (sorted(rows), sorted(_commands()))
    assert len(rows) == len(set(rows))


def test_cli_reference_is_generated_from_the_app():
    """docs/cli-reference.md is what docs/generate.py renders from cli.py today (regenerate after a CLI change)."""
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (ROOT / "docs" / "cli-reference.md").read_text()
    assert sorted(re.findall(r"^## `oracle ([a-z-]+)`$", text, flags=re.M)) == sorted(_commands())


def test_the_generator_notices_a_stale_reference(tmp_path, monkeypatch):
    """The check can fail: a reference missing one option line is reported stale."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "docs"))
    stale = tmp_path / "cli-reference.md"
    stale.write_text(generate.render().replace("| `--overwrite` / `--no-overwrite` |", "| `--overwrit` |", 1))
    monkeypatch.setattr(generate, "TARGET", stale)
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.main(["--check"]) == 1


def test_every_relative_link_in_readme_and_docs_resolves():
    """Links from README.md and docs/*.md to files of the repository point at files that exist."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]:
        for target in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_there_are_at_least_five_docs_pages_each_linked_from_the_readme():
    """docs/ holds the reference and design; README's Read on table links every page."""
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 5, pages
    unlinked = [p for p in pages if f"(docs/{p})" not in README]
    assert not unlinked, unlinked


SKIP_SITE = re.compile(r"pytest\.skip\(|\bskipif\(|importorskip\(")


def _listed(paragraph: str) -> set[str]:
    """The files a README paragraph names in backticks: a path with a folder sets the folder for the bare names after it."""
    folder, names = "", set()
    for token in re.findall(r"`([\w/.-]+\.py)`", paragraph):
        if "/" in token:
            folder = token.rsplit("/", 1)[0]
            names.add(token)
        else:
            names.add(f"{folder}/{token}")
    return names


def test_readme_skip_list_is_every_place_a_test_can_be_skipped_each_saying_why():
    """README's skip list names exactly the files of tests/ holding a skip (pytest -rs prints each skip at its file
    with its reason), every skipif gives a reason, and the CUDA count is the CUDA test's parametrization."""
    import importlib.util

    paragraph = README.split("**Skips**", 1)[1].split("\n\n", 1)[0]
    sites = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")) if SKIP_SITE.search(p.read_text())}
    assert _listed(paragraph) == set(sites), (sorted(_listed(paragraph) - set(sites)), sorted(set(sites) - _listed(paragraph)))
    for path, text in sites.items():
        for call in re.findall(r"skipif\((.*?)\)\s*\n", text, flags=re.S):
            assert "reason=" in call, (path, call)
    spec = importlib.util.spec_from_file_location("autocast_diff", ROOT / "tests" / "unit" / "test_autocast_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert f"{2 * len(mod.CASES)} CUDA cases" in paragraph, paragraph


def test_the_exit_code_6_text_names_overwrite_only_for_commands_that_have_it():
    """Every command's --help ends with the exit-code table; code 6 names the commands where --overwrite replaces an
    output: each of them has the option, and judge and demo (whose --out is their work folder) have none (issue 42:
    `judge --help` said "pass --overwrite" and `judge --overwrite` was a usage error)."""
    from oracle.errors import EXIT_CODES

    command = typer.main.get_command(app)
    has = {name: any("--overwrite" in p.opts for p in cmd.params) for name, cmd in command.commands.items()}
    named = EXIT_CODES[6].split("(", 1)[1].split(": pass --overwrite")[0].split(", ")
    assert named and all(has[n] for n in named), (named, has)
    assert {n for n, h in has.items() if h} == set(named), has
    assert not has["judge"] and not has["demo"] and "judge and demo" in EXIT_CODES[6]

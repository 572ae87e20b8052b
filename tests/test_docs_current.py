"""The documentation against the code: the generated pages (the CLI reference, the settings reference) are what
tophat/docs_gen.py makes of the code now, every setting says what it means, and every relative link in README.md
and docs/ points at a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tophat import docs_gen

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("relative", sorted(docs_gen.PAGES))
def test_generated_page_is_current(relative):
    path = REPO / relative
    assert path.exists(), f"{relative} is missing: run `make docs`"
    assert path.read_text(encoding="utf-8") == docs_gen.PAGES[relative](), f"{relative} is stale: run `make docs`"


def test_every_setting_has_a_meaning():
    page = docs_gen.configuration_page()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 150  # every service's fields, not an empty table
    blank = [row.split("|")[1].strip() for row in rows if not row.rstrip(" |").split("|")[-1].strip()]
    assert not blank, f"settings without a comment in their class (say what they mean there): {blank}"


def test_every_cli_command_is_in_the_reference():
    import typer.main

    from tophat.cli import app

    root = typer.main.get_command(app)
    page = (REPO / "docs/usage/cli.md").read_text(encoding="utf-8")
    for name in docs_gen.shown_commands(root, root.context_class(root)):
        assert f"## `tophat {name}`" in page


def documents() -> list[Path]:
    candidates = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [path for path in candidates if path.exists()]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)} links to missing files: {broken}"


def test_readme_is_for_users():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 320
    assert "make test" in text  # the test command CI runs (.ci/run)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated results belong in docs/benchmarks/"
    assert not re.search(r"\bsession \d+|\bissue \d+|\b[0-9a-f]{7,40}\b", text)
    assert "shared/papers" not in text and "../" not in text  # nothing outside the repository


def test_readme_modes_table_lists_every_mode():
    from shared.modes import MODE_TABLE

    text = (REPO / "README.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    assert set(MODE_TABLE) <= rows, f"modes missing from README.md's table: {set(MODE_TABLE) - rows}"

"""The module map (docs/design/modules.md): every module of the product, folder by folder, with the first sentence
of its docstring, so each module is named once, where it lives. Read with `ast` (nothing is imported); a page of
tophat/docs_gen.py, kept current by tests/test_docs_current.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGES = ("shared", "services", "tophatctl", "loadgen", "tophat")
SUMMARY_CHARS = 220  # a summary longer than this is cut at a word


def summary(docstring: str) -> str:
    """The docstring's first sentence (its first paragraph when that has no sentence end), on one line."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    match = re.search(r"(?<![ .]\w)(?<!e\.g)(?<!i\.e)[.:](\s|$)", paragraph)
    sentence = (paragraph[: match.start()] if match else paragraph).rstrip(".:")
    if len(sentence) > SUMMARY_CHARS:
        sentence = sentence[:SUMMARY_CHARS].rsplit(" ", 1)[0] + " ..."
    return sentence


def modules(root: Path, package: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Per folder of `package` (relative to `root`), a folder first: its `__init__.py`'s summary ("" without a
    docstring) and its modules with their summaries, in path order."""
    folders: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for path in sorted((root / package).rglob("*.py")):
        folder = path.parent.relative_to(root).as_posix() + "/"
        about, entries = folders.setdefault(folder, ("", []))
        text = summary(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
        if path.name == "__init__.py":
            folders[folder] = (text, entries)
        else:
            entries.append((path.relative_to(root).as_posix(), text))
    return dict(sorted(folders.items()))  # a folder before its subfolders


def escaped(text: str) -> str:
    return text.replace("|", "\\|")


def module_map_page(root: Path, generated_note: str) -> str:
    lines = [
        "# Module map",
        "",
        generated_note,
        "",
        "Every module of the product, by folder, with the first sentence of its docstring. The layers import",
        "downwards only (`shared/` < `services/` < `tophatctl/` < `loadgen/` < `tophat/`, tests/test_architecture.py);",
        "[request-lifecycle.md](request-lifecycle.md) walks them in the order a request meets them.",
    ]
    for package in PACKAGES:
        for folder, (about, entries) in modules(root, package).items():
            lines += ["", f"## `{folder}`", ""] + ([about + ".", ""] if about else [])
            lines += ["| module | what it is |", "|---|---|"]
            lines += [f"| `{relative}` | {escaped(text)} |" for relative, text in entries]
    return "\n".join(lines) + "\n"

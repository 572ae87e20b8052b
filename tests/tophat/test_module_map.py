"""The module map page (tophat/module_map.py): each module named once, with its docstring's first sentence."""

from __future__ import annotations

from pathlib import Path

from tophat.module_map import PACKAGES, SUMMARY_CHARS, module_map_page, summary


def test_summary_is_the_first_sentence_on_one_line():
    assert summary("The wire.\n\nMore about it.") == "The wire"
    assert summary("What a device\nsends: hidden states. Never ids.") == "What a device sends"
    assert summary("Drafts (e.g. a tree) go up. Then verdicts.") == "Drafts (e.g. a tree) go up"
    assert summary("One paragraph with no end") == "One paragraph with no end"


def test_a_long_summary_is_cut_at_a_word():
    text = summary("word " * 100)
    assert len(text) <= SUMMARY_CHARS + 4 and text.endswith(" ...") and "wor ..." not in text


def test_every_module_is_named_once():
    root = Path(__file__).resolve().parents[2]
    page = module_map_page(root, "")
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            if path.name != "__init__.py":
                assert page.count(f"| `{path.relative_to(root).as_posix()}` |") == 1, path

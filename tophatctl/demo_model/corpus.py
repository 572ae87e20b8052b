"""The demo corpus: the Python standard library of the running interpreter.

Every machine that runs Tophat has it, so the demo model can be rebuilt offline.
Files are split into train / held-out by a stable hash of their relative path.
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# Test suites are excluded: they are large, repetitive and not what users prompt with.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
# One file in twenty is held out (5%); the split depends only on the relative path.
HELD_OUT_MODULUS = 20


@dataclass(frozen=True)
class CorpusFile:
    relative_path: str
    text: str

    @property
    def is_held_out(self) -> bool:
        return _held_out_path(self.relative_path)


def _held_out_path(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_corpus_files(root: Path | None = None, held_out: bool | None = None) -> list[CorpusFile]:
    """The corpus's files; held_out True or False: only those of that side of the split, chosen by path
    before any file is read."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in relative.parts):
            continue
        if held_out is not None and _held_out_path(str(relative)) != held_out:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(CorpusFile(str(relative), text))
    return files


def split_corpus(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    train = [f for f in files if not f.is_held_out]
    held_out = [f for f in files if f.is_held_out]
    return train, held_out


@functools.cache
def held_out_files() -> tuple[CorpusFile, ...]:
    """The held-out files of this interpreter's standard library (split_corpus's second list), read once
    per process: the benchmarks and tests ask for held-out prompts many times."""
    return tuple(iter_corpus_files(held_out=True))


def held_out_prompts(num_prompts: int, prompt_chars: int = 400, seed: int = 0) -> list[str]:
    """Prompts cut from held-out files at line boundaries (deterministic for a seed)."""
    import random

    held_out = held_out_files()
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < num_prompts:
        text = rng.choice(held_out).text
        lines = text.splitlines(keepends=True)
        if len(lines) < 10:
            continue
        start = rng.randrange(0, max(1, len(lines) - 10))
        prompt = ""
        for line in lines[start:]:
            if len(prompt) + len(line) > prompt_chars:
                break
            prompt += line
        if len(prompt) > prompt_chars // 4:
            prompts.append(prompt)
    return prompts

"""Prompts for distilling a draft adapter on a chat model, built offline from text every machine
has: the docstrings of Python's standard library and the descriptions of the installed Debian
packages. The held-out chat prompts that acceptance is measured on are written here by hand and
are never used for training.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from collections import deque
from pathlib import Path

from tophatctl.demo_model.corpus import iter_corpus_files

DPKG_STATUS = Path("/var/lib/dpkg/status")

HELD_OUT_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for writing clear Python functions.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the ocean.",
    "How do I reverse a list in Python?",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a coffee shop and explain why.",
    "How does a rainbow form?",
    "Write a polite email declining a meeting invitation.",
    "What is machine learning?",
    "List five fruits that are high in vitamin C.",
    "Why is the sky blue?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "How do vaccines work?",
    "Give me a recipe for a simple tomato pasta.",
    "What is the Pythagorean theorem?",
    "Describe the water cycle.",
    "What are some good habits for learning a new language?",
    "Explain the difference between RAM and storage.",
    "Write a haiku about autumn leaves.",
    "How can I improve my sleep?",
)


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


_HELD_OUT_WORDS = tuple(_words(p) for p in HELD_OUT_CHAT_PROMPTS)


def near_held_out(prompt: str, threshold: float = 0.5) -> bool:
    """Whether a training prompt is, or is close to, a held-out one: the same words, or word sets
    overlapping by `threshold` (Jaccard). Prompts the model writes itself (`sample_user_prompts`) can
    land on an everyday question like ours; acceptance measured on them would flatter the adapter."""
    words = _words(prompt)
    return any(len(words & held) >= threshold * len(words | held) for held in _HELD_OUT_WORDS)


_DOC_TEMPLATES = (
    "Explain this in simple terms: {text}",
    "Summarize the following in one sentence: {text}",
    "What does this mean? {text}",
    "Rewrite this so a beginner can understand it: {text}",
    "Give an example that illustrates this: {text}",
    "What is the Python function `{name}` used for? Its documentation says: {text}",
    "Write a short Python example that uses `{name}`.",
    "What questions might someone ask about `{name}`?",
)
_PACKAGE_TEMPLATES = (
    "What is the {name} package used for?",
    "Describe {name} in a few sentences: {text}",
    "Explain this software description to a non-expert: {text}",
    "Who would need {name}, and why? Description: {text}",
    "List three things a user can do with {name}. It is described as: {text}",
)
_TOPIC_TEMPLATES = (
    "What is {topic}?",
    "Explain {topic} in two sentences.",
    "Give me three facts about {topic}.",
    "Write a short paragraph about {topic}.",
    "Why is {topic} important?",
    "How would you teach {topic} to a child?",
)
_GENERAL_TEMPLATES = _TOPIC_TEMPLATES + (
    "Write a short poem about {topic}.",
    "Give me some tips about {topic}.",
    "What are the pros and cons of {topic}?",
    "Tell me a short story that involves {topic}.",
    "How does {topic} work?",
    "What is the difference between {topic} and {other}?",
    "Write a friendly message to a colleague about {topic}.",
    "List five words related to {topic}.",
    "What would a beginner need to know about {topic}?",
    "Describe {topic} to someone who has never seen it.",
    "Summarize the history of {topic} in a few sentences.",
    "What questions should I ask before choosing {topic}?",
)
_STOP_WORDS = frozenset(
    "this that with from have will when which their there these those into then than been were what where "
    "return returns value values none true false object objects default given used using uses only also more "
    "must should would could other each such some does like same just them they your first last used".split()
)


def _clean(text: str, max_chars: int) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind(" ")] if " " in cut else cut


# Where a function or class definition can sit: statements hold them, and except clauses and match cases hold
# statements; an expression never does.
_HOLDS_DEFINITIONS = (ast.stmt, ast.excepthandler, ast.match_case)


def _statements(tree: ast.AST):
    """The tree's statements (and except clauses and match cases) in ast.walk's order, without visiting the
    expressions ast.walk spends most of its time in: every ancestor of a statement is one of these, so the
    order among them is the same."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _HOLDS_DEFINITIONS))
        yield node


@functools.cache
def _stdlib_first_paragraphs() -> tuple[tuple[str, str], ...]:
    """(qualified name, raw first docstring paragraph) of public stdlib functions and classes: the
    stdlib is parsed once, whatever lengths the callers cut the paragraphs to."""
    found = []
    for corpus_file in iter_corpus_files():
        try:
            tree = ast.parse(corpus_file.text)
        except SyntaxError:
            continue
        module = corpus_file.relative_path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for node in _statements(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                found.append((f"{module}.{node.name}", doc.split("\n\n")[0]))
    return tuple(found)


@functools.cache
def stdlib_docstrings(max_chars: int = 300) -> list[tuple[str, str]]:
    """(qualified name, first paragraph of its docstring, cut to max_chars) for public stdlib functions and classes."""
    return [(name, _clean(paragraph, max_chars)) for name, paragraph in _stdlib_first_paragraphs()]


def debian_packages(status: Path = DPKG_STATUS, max_chars: int = 300) -> list[tuple[str, str]]:
    """(package, description) of the installed Debian packages; empty where there is no dpkg."""
    if not status.is_file():
        return []
    packages = []
    for stanza in status.read_text(errors="replace").split("\n\n"):
        name = re.search(r"^Package: (\S+)", stanza, re.M)
        desc = re.search(r"^Description: (.*(?:\n [^\n]*)*)", stanza, re.M)
        if name and desc:
            text = desc.group(1).replace("\n .", "\n").replace("\n ", " ")
            packages.append((name.group(1), _clean(text, max_chars)))
    return packages


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct chat prompts mixing stdlib docs, package descriptions and general topics
    taken from their words; none is one of the held-out prompts."""
    rng = random.Random(seed)
    docs = stdlib_docstrings()
    packages = debian_packages()
    topics = sorted({w.lower() for _, text in docs + packages for w in re.findall(r"\b[A-Za-z]{7,14}\b", text)})
    prompts: set[str] = set()
    attempts = 0
    while len(prompts) < count and attempts < 50 * count:
        attempts += 1
        kind = rng.random()
        if kind < 0.45 and docs:
            name, text = rng.choice(docs)
            prompt = rng.choice(_DOC_TEMPLATES).format(name=name, text=text)
        elif kind < 0.75 and packages:
            name, text = rng.choice(packages)
            prompt = rng.choice(_PACKAGE_TEMPLATES).format(name=name, text=text)
        elif topics:
            prompt = rng.choice(_TOPIC_TEMPLATES).format(topic=rng.choice(topics))
        else:
            continue
        if not near_held_out(prompt):
            prompts.add(prompt)
    return sorted(sorted(prompts), key=lambda p: rng.random())  # sorted first: a set's order varies per process


@functools.cache
def common_words(count: int = 1500) -> list[str]:
    """The most frequent plain English words of the docstrings and package descriptions: the
    everyday topics those texts talk about (file, music, network, language, image, ...)."""
    from collections import Counter

    words = Counter(
        w for _, text in stdlib_docstrings() + debian_packages() for w in re.findall(r"\b[a-z]{4,12}\b", text)
    )
    return [w for w, _ in words.most_common(count + len(_STOP_WORDS)) if w not in _STOP_WORDS][:count]


def general_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct everyday chat prompts: general templates over the texts' common words."""
    rng = random.Random(seed + 2)
    words = common_words()
    prompts: set[str] = set()
    for _ in range(50 * count):
        if len(prompts) >= count:
            break
        topic, other = rng.sample(words, 2)
        prompt = rng.choice(_GENERAL_TEMPLATES).format(topic=topic, other=other)
        if not near_held_out(prompt):
            prompts.add(prompt)
    return sorted(sorted(prompts), key=lambda p: rng.random())  # sorted first: a set's order varies per process


def teacher_forced_texts(count: int, seed: int = 0, min_chars: int = 200) -> list[str]:
    """Plain passages (longer docstrings and package descriptions) run through the model as they are."""
    rng = random.Random(seed + 1)
    passages = [
        text for _, text in stdlib_docstrings(max_chars=900) + debian_packages(max_chars=900) if len(text) >= min_chars
    ]
    rng.shuffle(passages)
    return passages[:count]

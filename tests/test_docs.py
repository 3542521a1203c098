"""The documentation cannot drift: every repository file the README, DESIGN.md, docs/*.md and bench/RESULTS.md
cite exists; docs/recipes.md is what scripts/recipes_doc.py generates from the config dataclasses; the README
stays a short front page without run numbers."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("bench/", "moela/", "recipes/", "tests/", "docs/", "scripts/", ".ci/")
# a path: a top-level folder then path characters; stops at spaces, quotes, brackets and trailing punctuation
PATH = re.compile(r"(?<![\w/.~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)")
BARE_MD = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
MD_HOMES = ("", "docs", "bench", "bench/results", "bench/notes")


def cited_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "DESIGN.md", ROOT / "bench" / "RESULTS.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def missing_citations(text: str, base: Path, root: Path = ROOT) -> list[str]:
    """Repository paths `text` (a Markdown file in folder `base`) names that do not exist: paths under a top-level
    folder (relative to the root), relative links (to `base`), and bare `NAME.md` names (found in the root, docs/,
    bench/, bench/results/ or bench/notes/). A path holding a placeholder (`<`, `*`, `{`) is a pattern, not a
    citation."""
    missing = []
    for path in PATH.findall(text):
        if not any(c in path for c in "<*{") and not (root / path).exists():
            missing.append(path)
    for link in LINK.findall(text):
        if "://" not in link and not link.startswith("mailto:") and not (base / link).exists():
            missing.append(link)
    for name in BARE_MD.findall(text):
        if not any((root / home / name).exists() for home in MD_HOMES):
            missing.append(name)
    return sorted(set(missing))


def test_the_checker_finds_a_missing_file(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "step.md").write_text("x")
    text = ("`bench/results/step.md`, bench/results/gone.md, [here](bench/results/step.md), [there](nope.md), "
            "`step.md`, `old_run3.md`, bench/results/<script>.md, https://example.com/bench/x.md")
    assert missing_citations(text, tmp_path, tmp_path) == ["bench/results/gone.md", "nope.md", "old_run3.md"]


@pytest.mark.parametrize("doc", cited_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_file_exists(doc):
    assert doc.is_file(), f"{doc.relative_to(ROOT)} is missing"
    missing = missing_citations(doc.read_text(), doc.parent)
    assert missing == [], f"{doc.relative_to(ROOT)} cites files that do not exist: {missing}"


def test_recipes_page_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location("recipes_doc", ROOT / "scripts" / "recipes_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.render()
    assert (ROOT / "docs" / "recipes.md").read_text() == expected, \
        "docs/recipes.md is stale: python scripts/recipes_doc.py > docs/recipes.md"


def test_readme_is_a_short_front_page_without_run_history():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\bruns? \d+\b|_run\d+", text), "run numbers belong in bench/notes, not the README"

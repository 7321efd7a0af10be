"""The README and the docs point only at files in this repository: every relative Markdown link
resolves to a file or folder inside the repo, and every repo path quoted in backticks
(``tools/run.sh``) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "tools" / "results" / "README.md"]
# Top-level folders of the repo: a backticked path starting with one names a repo file.
REPO_DIRS = ("engine_core", "frontend", "worker", "csrc", "tests", "tools", "docs")

_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"`([^`\s]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(text: str) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", text))]


def _inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repo(doc):
    assert doc.is_file()
    for target in _links(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        path = doc.parent / target.split("#", 1)[0]
        assert _inside_repo(path), f"{doc.name}: {target} points outside the repo"
        assert path.exists(), f"{doc.name}: {target} does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repo_paths_exist(doc):
    for token in _CODE.findall(doc.read_text(encoding="utf-8")):
        path = token.rstrip(".,:;")
        assert not path.startswith(("shared/", "../")), \
            f"{doc.name}: `{token}` names a file outside the repo"
        if path.split("/", 1)[0] in REPO_DIRS and "/" in path and "*" not in path:
            assert (ROOT / path).exists(), f"{doc.name}: `{token}` does not exist"


def test_the_link_check_catches_a_bad_link():
    # The checks above would be vacuous if the patterns matched nothing.
    text = "see [x](docs/BENCHMARKS.md#rules), [y](../shared/BENCHMARKS.md) and [z](http://a/b)"
    assert _links(text) == ["docs/BENCHMARKS.md#rules", "../shared/BENCHMARKS.md", "http://a/b"]
    assert not _inside_repo(ROOT / "../shared/BENCHMARKS.md")
    assert "docs/BENCHMARKS.md" in _links((ROOT / "README.md").read_text(encoding="utf-8"))

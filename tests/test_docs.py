"""The documentation's shape: every relative link and ``#anchor`` resolves, the README stays a front page.

Checked files: ``README.md``, every ``docs/*.md`` and ``benchmarks/README.md``. A link is checked when it is relative
(no scheme, not ``mailto:``): its file must exist, and its ``#anchor`` must be one a heading of that file gives,
computed as GitHub does (lowercase; spaces to ``-``; punctuation other than ``-`` and ``_`` dropped; a repeated
heading gets ``-1``, ``-2``, ...). Links inside code blocks and code spans are not links and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")".
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference definitions)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers (1-based)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = _CODE_SPAN.sub(lambda match: match.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(char for char in text if char.isalnum() or char in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: its headings, GitHub-style and de-duplicated, and explicit HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """The link targets of a markdown file outside code blocks and code spans, with their line numbers."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
            continue
        prose = _CODE_SPAN.sub("", line)
        found += [(number, target) for target in _INLINE_LINK.findall(prose)]
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` whose file or anchor does not exist, as 'file:line: target (why)' (files named
    relative to ``root``)."""
    problems = []
    for number, target in links(path):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:, ...): not checked offline
        file_part, _, anchor = target.partition("#")
        linked = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where} (no heading gives #{anchor} in {linked.relative_to(root)})")
        elif anchor and linked.suffix != ".md":
            problems.append(f"{where} (an anchor into a file that is not markdown)")
    return problems


@pytest.mark.parametrize("path", documents(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert path.exists(), path
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_catches_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section: with `code`, punctuation & more\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Twice\n\n## Twice\n\n"
        "[ok](other.md#a-section-with-code-punctuation--more) [ok](#twice-1) [ok](#page) [web](https://example.com/x)\n"
        "`[not a link](missing.md)`\n\n```\n[not a link either](missing.md)\n```\n"
        "[bad file](missing.md) [bad anchor](other.md#no-such-heading) [bad local](#twice-2)\n"
    )
    problems = [problem.split(": ", 1)[1] for problem in broken_links(page, root=tmp_path)]
    assert problems == [
        "missing.md (no such file)",
        "other.md#no-such-heading (no heading gives #no-such-heading in other.md)",
        "#twice-2 (no heading gives #twice-2 in page.md)",
    ]


def test_github_anchors():
    assert github_anchor("Comparing budgets: `examples/sweep.sh`") == "comparing-budgets-examplessweepsh"
    assert github_anchor("`hf-dynbsz plan`") == "hf-dynbsz-plan"
    assert github_anchor("`per_device_generation_batch_size`: the generation chunk") == (
        "per_device_generation_batch_size-the-generation-chunk"
    )
    assert github_anchor("Licence and citation") == "licence-and-citation"


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: move the detail into docs/"
    )


def test_readme_has_the_test_command_block():
    """.ci/run reads the ```bash block right after the line <!-- test-command --> (blank lines allowed between)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines.count("<!-- test-command -->") == 1, "README.md needs exactly one <!-- test-command --> line"
    rest = lines[lines.index("<!-- test-command -->") + 1 :]
    while rest and not rest[0].strip():
        rest = rest[1:]
    assert rest and rest[0].strip() == "```bash", "the line after <!-- test-command --> must open a ```bash block"
    body = rest[1 : rest.index("```")]
    command = "\n".join(body)
    assert "python -m pytest" in command and "ruff check ." in command, command
    assert 'python -m pytest -m "not slow"' in README.read_text(encoding="utf-8"), "the quick subset is documented"


def test_every_docs_page_is_in_the_readme_index():
    readme = README.read_text(encoding="utf-8")
    missing = [path.name for path in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{path.name})" not in readme]
    assert not missing, f"docs pages the README's documentation index does not link: {missing}"

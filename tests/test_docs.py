"""The documents stay true: CI runs the README's test command, the README stays short, and every link in the
README and docs/ leads to a file (and heading) inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def _links(document: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def _anchors(document: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2 and "fafo run --prompt examples/prompt.txt" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert [line for line in ci if line.startswith("python3 -m venv")] == [commands[1]]
    assert (ROOT / "examples" / "prompt.txt").is_file()


def test_readme_is_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for document in DOCUMENTS:
        for target in _links(document):
            if EXTERNAL.match(target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{document.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{document.name}: {target} (no such heading)")
    assert not broken, broken


def test_link_check_catches_bad_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n[up](../shared/design/fafo.md)\n[ref]: ../x.md\n[here](#a-heading) "
                    "[gone](#nowhere) `[code](not-a-link.md)`\n```\n[block](neither.md)\n```\n")
    assert _links(page) == ["../shared/design/fafo.md", "#a-heading", "#nowhere", "../x.md"]
    assert _anchors(page) == {"a-heading"}


def test_no_document_points_outside_the_repository():
    for document in DOCUMENTS:
        assert "../shared" not in document.read_text(), document.name

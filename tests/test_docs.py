"""The docs tree: the README is a front page that links every docs page, links resolve, and the command
outputs pasted into docs are what the commands print today (tools/docs_outputs.py)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if "://" not in target]


def test_readme_is_a_front_page_linking_every_docs_page():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 200
    assert "## Quick start" in readme.read_text()
    linked = {(ROOT / target).resolve() for target in _links(readme)}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    unlinked = [page.name for page in pages if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(ROOT)} -> {target}"
              for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
              for target in _links(page) if not (page.parent / target).exists()]
    assert not broken, broken


def test_pasted_command_outputs_are_current():
    result = subprocess.run([sys.executable, "tools/docs_outputs.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

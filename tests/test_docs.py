"""The user's guide in docs/ builds with `mkdocs build --strict`: no broken link, anchor or
page missing from the nav."""

import subprocess
import sys

from conftest import REPO


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "configs" / "index.html").is_file()


def test_the_reference_page_is_the_arguments_as_they_are():
    """docs/reference.md is recipes/arguments.py's output: a new or changed argument without the
    page regenerated fails here."""
    proc = subprocess.run([sys.executable, "recipes/arguments.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (REPO / "docs" / "reference.md").read_text() == proc.stdout, \
        "stale: python recipes/arguments.py > docs/reference.md"

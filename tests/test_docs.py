"""The documentation's links: every relative link in README.md, CONTRIBUTING.md and docs/ names
a file that exists and, with a #fragment, a heading in it (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading (pure)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


ANCHORS = {
    # heading: anchor
    "Set-up: two commands": "set-up-two-commands",
    "Workers on this machine: `tfdist launch`": "workers-on-this-machine-tfdist-launch",
    "PyTorch (DDP)": "pytorch-ddp",
    "Job scripts and `tfdist job`": "job-scripts-and-tfdist-job",
}


@pytest.mark.parametrize("heading", sorted(ANCHORS))
def test_anchor(heading):
    assert anchor(heading) == ANCHORS[heading]


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_guide_for_the_cluster_user():
    # At most 500 lines; the cluster install first, then the five steps, and the developer
    # set-up after the troubleshooting. Test material and measurements live in docs/.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 500, f"README.md has {len(lines)} lines: move detail to docs/"
    headings = [line[3:] for line in FENCE.sub("", "\n".join(lines)).splitlines()
                if line.startswith("## ")]
    assert headings[:2] == ["Install on a cluster", "From one GPU to Slurm in five steps"], headings
    assert headings.index("When things go wrong") < headings.index(
        "Working on tfdist: two commands"), headings

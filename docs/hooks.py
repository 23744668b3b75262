"""MkDocs hooks (mkdocs.yml `hooks:`): the site shows the repository's root pages, and links work on GitHub and in the
site.

BENCHMARKS.md and ARCHITECTURE.md live at the repository's root (tests read them there). Their site pages,
docs/benchmarks.md and docs/architecture.md, are stubs whose text this hook replaces with the root file's.
The docs pages link to the root files as `../BENCHMARKS.md#section`, which is right on GitHub; in the site the
hook points those links at the pages that hold the same text. Links inside the root files to `docs/x.md` become
`x.md`, the page beside them in the site.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDED = {"benchmarks.md": "BENCHMARKS.md", "architecture.md": "ARCHITECTURE.md"}
TO_PAGE = {root: page for page, root in INCLUDED.items()}


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    src = page.file.src_uri
    if src in INCLUDED:
        markdown = (ROOT / INCLUDED[src]).read_text()
        return re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", markdown)
    if "/" in src:  # the API pages link to no root file
        return markdown
    return re.sub(r"\]\(\.\./(BENCHMARKS\.md|ARCHITECTURE\.md)", lambda m: f"]({TO_PAGE[m.group(1)]}", markdown)

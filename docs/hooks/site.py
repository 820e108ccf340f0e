"""MkDocs hook: small fixes that keep the site's pages and the GitHub-readable sources the same.

* ``docs/losses.md`` and ``docs/agents.md`` (written with the loss family and the agent endpoint)
  join the nav under Guides when they exist.
* Docstrings use a few reST roles (``:func:`x` ``); mkdocstrings renders Markdown, so the role
  prefix is dropped and the name keeps its code style; a reST ``::`` before a code block reads
  as ``:``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Guides other work adds; each joins the nav when its page exists (a page outside the nav fails
# the strict build, a nav entry without its page too).
OPTIONAL_GUIDES = {"losses.md": "Policy losses", "agents.md": "Agents: an OpenAI-compatible endpoint"}
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(<code>)")
_LITERAL = re.compile(r"::(</p>)")


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    for nav in config["nav"] or []:
        if isinstance(nav, dict) and "Guides" in nav:
            listed = {next(iter(p.values())) for p in nav["Guides"] if isinstance(p, dict)}
            for page, title in OPTIONAL_GUIDES.items():
                if (docs / page).is_file() and page not in listed:
                    nav["Guides"].append({title: page})
    return config


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri.startswith("reference/api/"):
        html = _ROLE.sub(r"\1", html)
        html = _LITERAL.sub(r":\1", html)
    return html

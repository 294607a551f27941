"""MkDocs hook: links from the docs to repository files outside ``docs/``.

The pages link to files that are not part of the site (``../benchmarks/README.md``,
``../src/ditops/config.py``, ``../tests/precision.py``): they read right on a code host
and in a checkout. MkDocs cannot check them (it knows the site's files only) and would
warn, so this hook checks them itself, a missing file being a warning (an error under
``--strict``), and points the built page at the file: ``repo_url``'s copy when the site
sets one, else the same relative path, which works for a site built into ``site/`` of a
checkout.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")

_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")
_SCHEME = "repo-file:"


def _root(config) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def on_page_markdown(markdown, page, config, files):
    """Check each link that leaves ``docs/`` and mark it, so MkDocs leaves it alone."""
    docs = Path(config["docs_dir"]).resolve()
    root = _root(config)

    def mark(match: re.Match) -> str:
        target = match.group(1)
        path, _, anchor = target.partition("#")
        here = (docs / page.file.src_uri).parent
        resolved = (here / path).resolve()
        if resolved.is_relative_to(docs) or not resolved.is_relative_to(root):
            return match.group(0)
        if not resolved.exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri, path)
        rel = resolved.relative_to(root).as_posix()
        return f"]({_SCHEME}{rel}{'#' + anchor if anchor else ''})"

    return _LINK.sub(mark, markdown)


#: A Sphinx role left in a docstring (``:class:`X```), as the API pages render it.
_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):(<code>)")


def on_page_content(html, page, config, files):
    """Point the marked links at the repository's file; drop Sphinx roles' markers."""
    html = _ROLE.sub(r"\1", html)
    repo = (config.get("repo_url") or "").rstrip("/")
    up = posixpath.relpath(".", posixpath.dirname(page.url) or ".")

    def href(match: re.Match) -> str:
        rel = match.group(1)
        url = f"{repo}/blob/main/{rel}" if repo else posixpath.join(up, "..", rel)
        return f'href="{url}"'

    return re.sub(rf'href="{_SCHEME}([^"]+)"', href, html)

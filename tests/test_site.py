"""The built docs site: every link stays in the site and lands (files and anchors), code
fits the column, the home page shows the results, the API page ``patch``'s real defaults.

The site is built once (``mkdocs build --strict``, seconds) into a temporary folder. Where
a headless Chromium is installed (Debian: ``apt-get install chromium-headless-shell``),
each page is also laid out at the narrowest desktop width with both sidebars and checked
for code blocks and tables wider than their box; without one, the width check below
holds the code to the column by character count.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Characters of code that fit Material's content column at 1220 px (both sidebars
#: shown), measured in Chromium: 78 of the code font.
COLUMN = 78
DESKTOP = 1220


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="pip install -e '.[docs]' installs it")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "link", "script"):
                self.links.append(a[key] or "")


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text())
    return p


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "search" not in p.parts)


@pytest.mark.slow  # builds the site (10-20 s on 2 cores)
def test_every_link_stays_in_the_site_and_lands(site: Path) -> None:
    parsed = {p: _parse(p) for p in pages(site)}
    broken = []
    for page, found in parsed.items():
        for link in found.links:
            parts = urlsplit(link)
            if parts.scheme in ("http", "https", "mailto", "data") or link.startswith("//"):
                continue
            base = site if parts.path.startswith("/") else page.parent  # 404.html: from the root
            path = unquote(parts.path).lstrip("/")
            target = (base / path).resolve() if parts.path else page
            where = f"{page.relative_to(site)} -> {link}"
            if not target.is_relative_to(site.resolve()):
                broken.append(f"{where}: leaves the site")
            elif target.is_dir():
                target = target / "index.html"
            if target.is_relative_to(site.resolve()) and not target.exists():
                broken.append(f"{where}: no such file")
            elif parts.fragment and target.suffix == ".html" and target.exists():
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where}: no such anchor")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_code_fits_the_column(site: Path) -> None:
    wide = []
    for page in pages(site):
        for pre in re.findall(r"<pre[^>]*>(.*?)</pre>", page.read_text(), re.S):
            for line in html.unescape(re.sub(r"<[^>]+>", "", pre)).splitlines():
                if len(line) > COLUMN:
                    wide.append(f"{page.name}: {len(line)}: {line}")
    assert not wide, f"code lines wider than the column ({COLUMN}):\n" + "\n".join(wide)


@pytest.mark.slow
def test_the_home_page_shows_the_results_and_the_api_page_patch_defaults(site: Path) -> None:
    home = (site / "index.html").read_text()
    assert "<table>" in home and "sparsity 0.75" in home and "NVIDIA H200" in home
    assert 'src="assets/results.svg"' in home and (site / "assets" / "results.svg").exists()
    api = html.unescape(re.sub(r"<[^>]+>", "", (site / "api.html").read_text()))
    assert "norms: bool = True" in api and "precision: str | None = None" in api
    assert "UNSET" not in api


#: Marks what overflows its box, after the page's own scripts ran: code blocks and the
#: page's content column. A table wider than the column scrolls inside its own wrapper,
#: by the theme's design (a release x family matrix cannot fit), so tables are not asked.
PROBE = r"""<script>window.addEventListener('load', () => {
  const out = [];
  document.querySelectorAll('pre > code, .md-content').forEach(e => {
    if (e.scrollWidth > e.clientWidth + 1)
      out.push(e.tagName + ' ' + e.scrollWidth + '>' + e.clientWidth + ' after #'
               + ((e.closest('.doc') || e).querySelector('[id]') || {id: '?'}).id + ': '
               + (e.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 80));
  });
  document.body.setAttribute('data-overflow', JSON.stringify(out));
});</script></body>"""


def _browser() -> str | None:
    return next(
        (b for b in ("chromium-headless-shell", "chromium", "chromium-browser") if shutil.which(b)),
        None,
    )


@pytest.mark.slow  # one headless browser per page: ~1 s each
def test_no_page_overflows_in_a_browser(site: Path, tmp_path: Path) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip("no headless Chromium (apt-get install chromium-headless-shell)")
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    over = {}
    for page in pages(copy):
        page.write_text(page.read_text().replace("</body>", PROBE, 1))
        cmd = [browser, "--no-sandbox", "--disable-gpu", "--headless",
               f"--window-size={DESKTOP},900", "--virtual-time-budget=3000",
               "--dump-dom", page.as_uri()]  # fmt: skip
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        found = re.search(r'data-overflow="([^"]*)"', dom)
        assert found, f"{page.name}: the probe did not run ({browser})"
        items = json.loads(html.unescape(found.group(1)))
        if items:
            over[page.name] = items
    assert not over, json.dumps(over, indent=1)

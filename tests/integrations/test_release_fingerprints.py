"""The fingerprint table says of the installed diffusers release what that release's code
is (run on each release by ``.ci/releases``): every relied-on function found has a
fingerprint the table lists for this release, and every entry listing it is found."""

from __future__ import annotations

import diffusers
import pytest

from ditops.integrations.shared.fingerprint_table import KNOWN, MAIN, MAIN_VERSION, RELEASES
from ditops.integrations.shared.release_survey import survey


def _release() -> str | None:
    version = diffusers.__version__
    if version in RELEASES:
        return version
    return MAIN if version == MAIN_VERSION else None


@pytest.mark.skipif(_release() is None, reason="a diffusers release the table does not cover")
def test_the_table_says_what_this_release_computes() -> None:
    release = _release()
    found = survey()
    for label, fps in found.items():
        for fp, sites in fps.items():
            seen = KNOWN[label].get(fp)
            assert seen is not None and release in seen.releases, (label, fp, sites, release)
    unpruned = survey(prune=False)  # the entries for hosts where the NPU probe is true
    for label, table in KNOWN.items():
        for fp, seen in table.items():
            if release in seen.releases:
                assert fp in {**found.get(label, {}), **unpruned.get(label, {})}, (label, fp)


def test_the_installed_release_is_covered() -> None:
    """The test environment's diffusers is one the table covers (a new release: survey
    it and extend the table, see docs/releases.md)."""
    assert _release() is not None, diffusers.__version__


@pytest.mark.skipif(_release() is None, reason="a diffusers release the table does not cover")
def test_ditops_info_says_what_is_served_on_this_release() -> None:
    """``ditops info``'s line reads every family's relied-on functions on this release,
    including those the release lacks (a family's older release has fewer)."""
    from ditops.integrations.release_table import diffusers_report

    report = diffusers_report()
    assert report["line"].startswith(f"diffusers {diffusers.__version__}: served deep: ")
    assert "wan" in report["deep"]

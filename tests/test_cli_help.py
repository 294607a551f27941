"""``ditops --help`` and each command's help read as plain text: no reST markup."""

from __future__ import annotations

import re

import pytest

from ditops import cli

MARKUP = re.compile(r"``|:(?:func|class|mod|meth|data|attr):`")


@pytest.mark.parametrize("argv", [[], ["info"], ["bench"], ["tune"]], ids=str)
def test_help_has_no_rst_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ditops")
    assert not MARKUP.findall(text), f"reST markup in ditops {' '.join(argv)} --help:\n{text}"

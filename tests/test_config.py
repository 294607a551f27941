"""Configuration knobs: parsing, validation, and the programmatic equivalents."""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops import config
from ditops.config import ConfigError, parse_custom_ops


def test_custom_ops_default_all() -> None:
    sel = parse_custom_ops("all")
    assert sel.is_enabled("fp32_layer_norm")
    assert parse_custom_ops("").is_enabled("anything")


def test_custom_ops_none_plus() -> None:
    sel = parse_custom_ops("none, +fp32_layer_norm")
    assert sel.is_enabled("fp32_layer_norm")
    assert not sel.is_enabled("block_sparse_attention")


def test_custom_ops_minus() -> None:
    sel = parse_custom_ops("-fp32_layer_norm")
    assert not sel.is_enabled("fp32_layer_norm")
    assert sel.is_enabled("gated_residual")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("all,none", "both 'all' and 'none'"),
        ("+fp32_layer_norm,-fp32_layer_norm", "both enables and disables fp32_layer_norm"),
        ("fp32_layer_norm", "bad entry 'fp32_layer_norm'"),
        ("+", "bad entry '+'"),
        ("+a b", "bad entry"),
    ],
)
def test_custom_ops_errors(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="expected|name each op") as info:
        parse_custom_ops(text)
    assert fragment in str(info.value)


def test_unknown_op_name_is_an_error_naming_the_registered_ones() -> None:
    # Refused on entry (configure and override), so it never breaks a later call.
    before = config.get()
    for call in (
        lambda: config.configure(custom_ops="+no_such_op"),
        lambda: config.override(custom_ops="-no_such_op").__enter__(),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        assert "no_such_op" in str(info.value) and "fp32_layer_norm" in str(info.value)
        assert config.get() == before
    m = ditops.FP32LayerNorm(8)
    with torch.no_grad():
        assert m.explain_call(torch.randn(2, 8)).chosen == "forward_cpu"


def test_unknown_op_name_from_the_environment_is_an_error_at_first_use() -> None:
    m = ditops.FP32LayerNorm(8)
    cfg = config.from_env({"DITOPS_CUSTOM_OPS": "-no_such_op"})
    with pytest.raises(ConfigError, match="no_such_op"):
        cfg.custom_ops.check_names(ditops.registered_ops())
    assert m(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize(
    ("text", "value"), [("1", True), ("true", True), ("0", False), ("off", False)]
)
def test_strict_parsing(text: str, value: bool) -> None:
    assert config.from_env({"DITOPS_STRICT": text}).strict is value


def test_bad_values_say_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="expected 1/0"):
        config.from_env({"DITOPS_STRICT": "maybe"})
    with pytest.raises(ConfigError, match="expected 'fast' or 'exact'"):
        config.from_env({"DITOPS_PRECISION": "quick"})


def test_env_is_read_by_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DITOPS_PRECISION", "exact")
    monkeypatch.setenv("DITOPS_CUSTOM_OPS", "none")
    try:
        cfg = config.reload()
        assert cfg.precision == "exact" and not cfg.custom_ops.is_enabled("fp32_layer_norm")
    finally:
        monkeypatch.delenv("DITOPS_PRECISION")
        monkeypatch.delenv("DITOPS_CUSTOM_OPS")
        config.reload()
    assert config.get().precision == "fast"


def test_override_restores_and_configure_persists() -> None:
    before = config.get()
    with ditops.override(precision="exact", strict=True) as cfg:
        assert cfg.precision == "exact" and cfg.strict
        assert config.get().version != before.version
    assert config.get().precision == before.precision and not config.get().strict
    try:
        ditops.configure(precision="exact")
        assert config.get().precision == "exact"
    finally:
        config.reload()


def test_override_validates() -> None:
    with pytest.raises(ConfigError):
        with ditops.override(precision="fastest"):
            pass
    with pytest.raises(ConfigError):
        ditops.configure(strict="yes")  # type: ignore[arg-type]


def test_sglang_switch_is_off_unless_set() -> None:
    assert config.sglang_enabled({}) is False
    assert config.sglang_enabled({"DITOPS_SGLANG": "1"}) is True
    with pytest.raises(ConfigError, match="DITOPS_SGLANG"):
        config.sglang_enabled({"DITOPS_SGLANG": "sure"})


def test_sglang_entry_point_is_inactive_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    monkeypatch.delenv("DITOPS_SGLANG", raising=False)
    monkeypatch.delenv("SGLANG_DIFFUSION_PLATFORM_OVERRIDE", raising=False)
    # In a fresh process: the entry point answers None, and neither it nor `import ditops`
    # imports sglang (whether or not sglang is installed).
    code = (
        "import sys, ditops\n"
        "from ditops.integrations.sglang import activate\n"
        "assert activate() is None\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'sglang imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

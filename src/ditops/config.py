"""Every environment knob of ditops, read in one place, validated, documented.

=====================  ===================================================================
``DITOPS_CUSTOM_OPS``  Which ops may take a fast path: ``all`` (default) or ``none``, then
                       comma-separated ``+name`` / ``-name`` entries (vLLM's syntax), e.g.
                       ``none,+fp32_layer_norm`` or ``-block_sparse_attention``. A disabled
                       op runs ``forward_native``. Unknown names are an error.
``DITOPS_STRICT``      ``1`` makes an unusable fast path (package missing, op missing,
                       kernel raising) raise instead of falling back. Default ``0``.
``DITOPS_PRECISION``   ``fast`` (default): within each op's stated tolerance of the native
                       path. ``exact``: bitwise equal to the native path on that device
                       (paths that cannot promise it are skipped).
``DITOPS_TUNE``        How a call chooses among several paths that can serve it under the
                       same precision (:mod:`ditops.core.tune`): ``on`` (default) times
                       them on the first call of each shape class and keeps the fastest,
                       remembered in a cache file per machine; ``cache`` uses the cached
                       choices but times nothing; ``off`` takes the first usable path in
                       declared order (deterministic, explained by ``ditops info``).
``DITOPS_CACHE_DIR``   Where the tuning cache lives: default ``$XDG_CACHE_HOME/ditops``,
                       else ``~/.cache/ditops`` (one that cannot be used is warned about:
                       choices stay in memory; ``ditops tune --clear`` resets it).
``DITOPS_SGLANG``      ``1`` activates ditops' plugin inside sglang's diffusion runtime
                       (:mod:`ditops.integrations.sglang`; a general plugin, no platform
                       slot); read in each of sglang's processes. Default ``0``: an
                       installed ditops never changes sglang on its own.
=====================  ===================================================================

Why ``DITOPS_TUNE=on`` by default: ditops exists to be fast on the machine at hand, and
which path is fastest was shown to depend on the machine (AMX or not) and on its load.
Timing never changes a result: only paths giving the bits of the path ``off`` would take
compete (in ``exact`` every path gives the meaning's; in ``fast`` only paths declaring
the same bits, :mod:`ditops.core.same_bits`), so ``on``, ``cache`` and ``off`` return the
same bits on one machine, under any load. It costs a few extra calls once per shape
class and machine. In ``fast`` the static choice itself may differ between machines (a
GPU's Triton path, a CPU's kernel), each within the op's tolerance.

The environment is read once, on first use; :func:`reload` reads it again.
:func:`configure` changes the **process-wide** settings from code (every thread sees them).
:func:`override` is a context manager that changes them **for the calling thread only**,
inside a ``with`` block; blocks nest, and two threads' blocks never see or undo each
other's settings. (Thread-local rather than a ``contextvars`` variable: torch.compile can
trace a thread-local read and guard on it, and cannot trace ``ContextVar.get``; asyncio
tasks that share a thread therefore share an override.) To give one model its own
precision, set ``module.precision`` (or ``ditops.patch(..., precision=...)``) instead.

Reading the settings takes no lock, so a compiled graph can read them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from ditops.core.registry import registered_ops
from ditops.tracing import trace_time_constant

Precision = Literal["fast", "exact"]
PRECISIONS: tuple[str, ...] = ("fast", "exact")
TUNE_MODES: tuple[str, ...] = ("off", "on", "cache")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A knob has a value ditops cannot use; the message says what is allowed."""


@dataclass(frozen=True)
class OpsSelection:
    """The parsed form of ``DITOPS_CUSTOM_OPS``."""

    default_enabled: bool = True
    enabled: frozenset[str] = field(default_factory=frozenset)
    disabled: frozenset[str] = field(default_factory=frozenset)
    text: str = "all"

    def is_enabled(self, name: str) -> bool:
        if name in self.enabled:
            return True
        if name in self.disabled:
            return False
        return self.default_enabled

    def names(self) -> frozenset[str]:
        return self.enabled | self.disabled

    def check_names(self, known: Iterable[str]) -> None:
        """Raise ConfigError when the selection names an op that is not registered."""
        known = set(known)
        unknown = sorted(self.names() - known)
        if unknown:
            raise ConfigError(
                f"DITOPS_CUSTOM_OPS={self.text!r} names unknown op(s) {', '.join(unknown)}; "
                f"registered ops are: {', '.join(sorted(known)) or '(none)'}"
            )


def parse_custom_ops(text: str) -> OpsSelection:
    """Parse ``all|none`` plus ``+name``/``-name`` entries, comma separated."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    allowed = "expected 'all' or 'none', then entries '+name' or '-name', comma separated"
    defaults = {e for e in entries if e in ("all", "none")}
    if len(defaults) > 1:
        raise ConfigError(f"DITOPS_CUSTOM_OPS={text!r} says both 'all' and 'none'; {allowed}")
    enabled: set[str] = set()
    disabled: set[str] = set()
    for entry in entries:
        if entry in ("all", "none"):
            continue
        sign, name = entry[0], entry[1:].strip()
        if sign not in "+-" or not name or not name.replace("_", "").isalnum():
            raise ConfigError(f"DITOPS_CUSTOM_OPS={text!r}: bad entry {entry!r}; {allowed}")
        (enabled if sign == "+" else disabled).add(name)
    both = enabled & disabled
    if both:
        raise ConfigError(
            f"DITOPS_CUSTOM_OPS={text!r} both enables and disables {', '.join(sorted(both))}; "
            "name each op at most once"
        )
    return OpsSelection(
        default_enabled="none" not in defaults,
        enabled=frozenset(enabled),
        disabled=frozenset(disabled),
        text=text,
    )


def parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{name}={text!r} is not a boolean; expected 1/0, true/false, yes/no or on/off"
    )


def parse_precision(text: str) -> Precision:
    value = text.strip().lower()
    if value not in PRECISIONS:
        raise ConfigError(f"DITOPS_PRECISION={text!r} is not allowed; expected 'fast' or 'exact'")
    return value  # type: ignore[return-value]


def parse_tune(text: str) -> str:
    value = text.strip().lower()
    if value not in TUNE_MODES:
        raise ConfigError(
            f"DITOPS_TUNE={text!r} is not allowed; expected one of {', '.join(TUNE_MODES)}"
        )
    return value


@dataclass(frozen=True)
class Config:
    """The settings in force. ``version`` counts installs of settings (for diagnostics)."""

    custom_ops: OpsSelection = field(default_factory=OpsSelection)
    strict: bool = False
    precision: Precision = "fast"
    tune: str = "on"
    cache_dir: str = ""  # DITOPS_CACHE_DIR as given ("": the default place)
    version: int = 0


def sglang_enabled(environ: dict[str, str] | None = None) -> bool:
    """``DITOPS_SGLANG``: whether ditops' sglang plugin is switched on.

    Read afresh on each call (sglang's plugin loader asks once per process, the hooks again);
    a value that is not a boolean raises :class:`ConfigError`.
    """
    env = os.environ if environ is None else environ
    return parse_bool("DITOPS_SGLANG", env.get("DITOPS_SGLANG", "0"))


def from_env(environ: dict[str, str] | None = None) -> Config:
    """Build a Config from environment variables (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    return Config(
        custom_ops=parse_custom_ops(env.get("DITOPS_CUSTOM_OPS", "all")),
        strict=parse_bool("DITOPS_STRICT", env.get("DITOPS_STRICT", "0")),
        precision=parse_precision(env.get("DITOPS_PRECISION", "fast")),
        tune=parse_tune(env.get("DITOPS_TUNE", "on")),
        cache_dir=env.get("DITOPS_CACHE_DIR", ""),
    )


_lock = threading.Lock()  # serialises writers only; readers take no lock
_process: Config | None = None
_counter = 0
_local = threading.local()  # .override: the calling thread's Config from override()


def _install(cfg: Config) -> Config:
    global _process, _counter
    _counter += 1
    _process = replace(cfg, version=_counter)
    return _process


def _stamped(cfg: Config) -> Config:
    global _counter
    with _lock:
        _counter += 1
        return replace(cfg, version=_counter)


def process_config() -> Config:
    """The process-wide settings (reads the environment on first use)."""
    cfg = _process
    if cfg is None:
        with _lock:
            cfg = _process if _process is not None else _install(from_env())
    return cfg


def get() -> Config:
    """The settings in force for the calling thread: its :func:`override`, else the
    process-wide ones (reading the environment on first use)."""
    cfg = getattr(_local, "override", None)
    if cfg is not None:
        return cfg
    cfg = _process
    return cfg if cfg is not None else process_config()


@trace_time_constant
def ensure_loaded() -> int:
    """Read the environment now if it has not been read (returns the settings' version).

    Called first when a compiled graph is traced: it runs as plain Python, so the lock
    and the environment are never traced, and :func:`get` then only reads attributes.
    """
    return process_config().version


def reload() -> Config:
    """Read the environment again, dropping settings made with :func:`configure`."""
    cfg = from_env()
    with _lock:
        return _install(cfg)


def _check_op_names(selection: OpsSelection) -> None:
    # `import ditops` registers every op.
    selection.check_names(registered_ops())


def _updated(
    base: Config,
    custom_ops: str | None,
    strict: bool | None,
    precision: str | None,
    tune: str | None = None,
) -> Config:
    cfg = base
    if custom_ops is not None:
        if not isinstance(custom_ops, str):
            raise ConfigError(
                f"custom_ops must be a string in DITOPS_CUSTOM_OPS syntax, got {custom_ops!r}"
            )
        selection = parse_custom_ops(custom_ops)
        _check_op_names(selection)
        cfg = replace(cfg, custom_ops=selection)
    if strict is not None:
        if not isinstance(strict, bool):
            raise ConfigError(f"strict must be a bool, got {strict!r}")
        cfg = replace(cfg, strict=strict)
    if precision is not None:
        if not isinstance(precision, str):
            raise ConfigError(f"precision must be 'fast' or 'exact', got {precision!r}")
        cfg = replace(cfg, precision=parse_precision(precision))
    if tune is not None:
        if not isinstance(tune, str):
            raise ConfigError(f"tune must be one of {', '.join(TUNE_MODES)}, got {tune!r}")
        cfg = replace(cfg, tune=parse_tune(tune))
    return cfg


def configure(
    *,
    custom_ops: str | None = None,
    strict: bool | None = None,
    precision: str | None = None,
    tune: str | None = None,
) -> Config:
    """Change the process-wide settings from code; ``None`` leaves a setting as it is.

    ``custom_ops`` takes the ``DITOPS_CUSTOM_OPS`` syntax; names must be registered ops.
    Validated before anything changes: a bad value raises :class:`ConfigError` and leaves
    the settings as they were. A thread inside an :func:`override` block keeps its
    override until the block ends.
    """
    new = _updated(process_config(), custom_ops, strict, precision, tune)
    with _lock:
        return _install(new)


@contextlib.contextmanager
def override(
    *,
    custom_ops: str | None = None,
    strict: bool | None = None,
    precision: str | None = None,
    tune: str | None = None,
) -> Iterator[Config]:
    """Change the settings for the calling thread inside a ``with`` block.

    Other threads keep theirs; on exit the thread's previous settings (an enclosing
    override, or the process-wide ones) are in force again, whatever other threads did
    meanwhile. Validated on entry, like :func:`configure`.
    """
    saved = getattr(_local, "override", None)
    new = _stamped(_updated(get(), custom_ops, strict, precision, tune))
    _local.override = new
    try:
        yield new
    finally:
        _local.override = saved

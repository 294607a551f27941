"""Choosing among a call's eligible paths by measurement (``DITOPS_TUNE``).

Which path is fastest depends on the machine (AMX or not, AVX-512 or not), on its load
and on the shape, so a fixed order written on one machine is wrong on the next. When
more than one path can serve a call under the precision in force, the dispatcher
(:meth:`ditops.core.op.CustomOp.run`) asks this module. The competitors are the op's
usable paths for the device kind and, unless the op opts out
(:attr:`~ditops.core.op.CustomOp.meaning_competes`: its meaning is a memory-bounded
oracle, not a contender), the meaning itself. In ``exact`` precision only paths that
promise bitwise equality with the meaning are usable, so every competitor gives the
same bits and any winner is fine; in ``fast`` each is within the op's tolerance.

**Shape classes.** Calls are bucketed by device kind, precision, and each tensor's dtype
and dims rounded to the nearest power of two (``bfloat16[0,13,11]``: ``[1, 8064, 1536]``),
so a model's calls make a handful of classes and a class is timed once.

**Timing** (``on``), on the first call of a class: the path ``off`` would take runs first
and its output is the call's result (timing never changes what a call returns); each
other competitor then runs once to warm up (a compiled path compiles here), then
:data:`ROUNDS` timed rounds run every competitor in alternating order (interleaved, so a
busy neighbour weighs on all alike), and the fastest by its best round wins. The static
choice is kept unless another is faster by :data:`KEEP_MARGIN`. Cost, once per class
and machine: ``n - 1`` warm-ups and ``ROUNDS * n`` timed calls for ``n`` competitors
(5 extra calls for a path against the meaning; for CPU FlexAttention its compile, some
seconds, plus about six attention calls). Calls whose competitors are not all usable on
this call (NaN inputs, grad enabled) and calls of a class another thread is timing take
the static choice and time nothing. Never inside ``torch.compile`` tracing (a traced
call keeps the static choice: the dispatcher does not come here then).

**Memory and the cache.** Choices live in this process and in a JSON file per machine
fingerprint (:func:`fingerprint`: CPU model and the flags that decide kernels, GPU
name, torch and ditops versions, intra-op threads) under ``DITOPS_CACHE_DIR``, else
``$XDG_CACHE_HOME/ditops``, else ``~/.cache/ditops``, as Triton's autotuner and cuDNN's
benchmark mode keep theirs. ``cache`` mode reads them and times nothing. A record whose
competitors differ from today's (a package installed, a path broken) is timed again.
An unreadable or unwritable cache is warned about once and ignored: tuning never breaks
a run. A winner that raises later falls back as any path does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ditops import config
from ditops._version import __version__
from ditops.core.calls import OpCall, invoke
from ditops.core.checks import dtype_name
from ditops.core.paths import NATIVE

if TYPE_CHECKING:
    from ditops.core.op import CustomOp, _Plan

logger = logging.getLogger("ditops")

#: Timed rounds per competitor, after one warm-up call each.
ROUNDS = 2
#: The static choice stays unless another competitor is faster by this fraction.
KEEP_MARGIN = 0.03
#: CPU flags that decide which kernels are fast (x86 names from /proc/cpuinfo).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

#: Returned by :func:`dispatch` when the static choice should run (nothing tuned applies).
STATIC = object()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The :data:`CPU_FLAGS` this CPU has (empty where /proc/cpuinfo is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) & frozenset(CPU_FLAGS)
    except OSError:
        pass
    return frozenset()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def fingerprint() -> dict[str, str]:
    """What makes tuned choices valid: the machine and the software (see module doc)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": _cpu_model(),
        "cpu_flags": ",".join(sorted(cpu_flags())),
        "gpu": gpu,
        "torch": torch.__version__,
        "ditops": __version__,
        "threads": str(torch.get_num_threads()),
    }


@functools.cache
def fingerprint_id() -> str:
    """A short hash of :func:`fingerprint` (the cache file's name)."""
    text = json.dumps(fingerprint(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file(cfg: config.Config | None = None) -> Path:
    """The cache file for this machine under the settings' cache directory."""
    cfg = cfg or config.get()
    return _cache_file(cfg.cache_dir, os.environ.get("XDG_CACHE_HOME", ""))


@functools.lru_cache(maxsize=16)
def _cache_file(cache_dir: str, xdg: str) -> Path:
    if cache_dir:
        root = Path(cache_dir).expanduser()
    else:
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "ditops"
    return root / f"tune-{fingerprint_id()}.json"


@dataclass(frozen=True)
class Choice:
    """One tuned shape class: the winner, the competitors and their best times (ms)."""

    winner: str
    candidates: tuple[str, ...]
    times_ms: dict[str, float]
    load: float  # 1-minute load average when measured
    source: str = "measured"  # or "cache"

    def why(self) -> str:
        """In words: the times that made the choice."""
        times = ", ".join(
            f"{n.removeprefix('forward_')} {t:.3g} ms" for n, t in sorted(self.times_ms.items())
        )
        return f"{times} (load {self.load:.2f}, {self.source})"


class _Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.choices: dict[str, Choice] = {}
        self.read: set[Path] = set()  # cache files already read
        self.busy: set[str] = set()  # classes being timed now
        self.classes: dict[tuple[Any, ...], str] = {}  # (dtype, shape)... -> class text
        self.warned = False


_table = _Table()
_deciding = threading.local()


def deciding() -> bool:
    """Whether the calling thread is inside the tuner's choice (timing or applying a
    tuned winner). A path's static preference (a rule written from other machines'
    measurements, such as "compiled FlexAttention only with AMX") is a reason only
    outside it: measurement replaces it."""
    return getattr(_deciding, "on", False)


def _bucket(n: int) -> int:
    return round(math.log2(n)) if n > 0 else -1


def shape_class(tensors: list[torch.Tensor]) -> str:
    """The bucket of a call's tensors: dtype and dims rounded to powers of two."""
    raw = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    text = _table.classes.get(raw)
    if text is None:
        text = " ".join(
            f"{dtype_name(dt)}[{','.join(str(_bucket(d)) for d in shape)}]" for dt, shape in raw
        )
        if len(_table.classes) < 4096:  # bounded: odd shapes do not grow it forever
            _table.classes[raw] = text
    return text


def class_key(op: str, kind: str, precision: str, tensors: list[torch.Tensor]) -> str:
    return f"{op}/{kind}/{precision}/{shape_class(tensors)}"


def _warn(message: str) -> None:
    if not _table.warned:
        _table.warned = True
        logger.warning("ditops tuning: %s (choices kept in memory only)", message)


def _load(path: Path) -> None:
    """Read a cache file once per process (a bad one is warned about and ignored)."""
    if path in _table.read:
        return
    _table.read.add(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        _warn(f"cannot read {path}: {exc}")
        return
    entries = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        _warn(f"{path} is not a ditops tuning cache")
        return
    for key, e in entries.items():
        try:
            choice = Choice(
                str(e["winner"]),
                tuple(map(str, e["candidates"])),
                {str(k): float(v) for k, v in e["times_ms"].items()},
                float(e.get("load", -1.0)),
                "cache",
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # one bad record does not spoil the others
        _table.choices.setdefault(key, choice)


def _save(path: Path) -> None:
    """Merge this process's measured choices into the cache file (atomic replace)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old = json.loads(path.read_text(encoding="utf-8")).get("choices", {})
        except (OSError, ValueError, AttributeError):
            old = {}
        with _table.lock:
            mine = {k: c for k, c in _table.choices.items() if c.source == "measured"}
        merged = dict(old) if isinstance(old, dict) else {}
        for key, c in mine.items():
            record = asdict(c)
            record.pop("source")
            merged[key] = record
        payload = {"fingerprint": fingerprint(), "choices": merged}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        _warn(f"cannot write {path}: {exc}")


def lookup(key: str, cfg: config.Config | None = None) -> Choice | None:
    """The choice for a class key (reading the cache file on first use)."""
    cfg = cfg or config.get()
    path = cache_file(cfg)
    if path not in _table.read:
        with _table.lock:
            _load(path)
    return _table.choices.get(key)


def choices(cfg: config.Config | None = None) -> dict[str, Choice]:
    """Every choice known: this process's and the cache file's (for ``ditops info``)."""
    lookup("", cfg)
    with _table.lock:
        return dict(sorted(_table.choices.items()))


def describe(found: dict[str, Choice]) -> list[str]:
    """Lines for people: per shape class, the winner and the times that chose it."""
    lines = []
    for key, c in found.items():
        op, kind, precision, shapes = key.split("/", 3)
        lines.append(f"  {op} {kind} {precision} {shapes}")
        lines.append(f"      -> {c.winner.removeprefix('forward_')}: {c.why()}")
    return lines or ["  (none yet)"]


def forget() -> None:
    """Forget every choice in memory (the cache file stays); for tests and ``ditops tune``."""
    with _table.lock:
        _table.choices.clear()
        _table.read.clear()
        _table.warned = False


def recorded(op: CustomOp, kind: str, plan: _Plan, call: OpCall) -> Choice | None:
    """The choice that applies to this call's class, if one is recorded (for
    explanations: nothing is timed)."""
    key = class_key(op.op_name, kind, plan.decision.precision, call.tensors())
    choice = lookup(key)
    cfg = config.get()
    if choice is None or (choice.candidates != plan.competitors and cfg.tune != "cache"):
        return None
    return choice


def _sync(kind: str) -> None:
    if kind != "cpu":
        torch.accelerator.synchronize()


def dispatch(
    op: CustomOp, kind: str, plan: _Plan, call: OpCall, tensors: list[torch.Tensor]
) -> Any:
    """Run the call on its class's tuned winner, or time the competitors (``on``) on an
    untuned class; :data:`STATIC` when the static choice should run instead."""
    outer = deciding()  # a path may call another op
    _deciding.on = True
    try:
        return _dispatch(op, kind, plan, call, tensors)
    finally:
        _deciding.on = outer


def _dispatch(
    op: CustomOp, kind: str, plan: _Plan, call: OpCall, tensors: list[torch.Tensor]
) -> Any:
    cfg = config.get()
    key = class_key(op.op_name, kind, plan.decision.precision, tensors)
    choice = lookup(key, cfg)
    if choice is not None and (choice.candidates == plan.competitors or cfg.tune == "cache"):
        return _run_winner(op, kind, plan, call, tensors, choice.winner)
    if cfg.tune != "on":
        return STATIC
    with _table.lock:
        if key in _table.busy:
            return STATIC
        _table.busy.add(key)
    try:
        return _measure(op, kind, plan, call, tensors, key, cfg)
    finally:
        with _table.lock:
            _table.busy.discard(key)


def _run_winner(
    op: CustomOp, kind: str, plan: _Plan, call: OpCall, tensors: list[torch.Tensor], name: str
) -> Any:
    if name == NATIVE:
        return invoke(type(op)._native, op, call)  # type: ignore[arg-type]
    for spec, fn in plan.paths:
        if spec.name == name:
            if op._call_reasons(spec, kind, call, tensors):
                return STATIC
            call.exact = plan.exact
            return op._run_path(kind, spec, fn, call)
    return STATIC  # not usable any more (broken, disabled): the static walk


def _measure(
    op: CustomOp,
    kind: str,
    plan: _Plan,
    call: OpCall,
    tensors: list[torch.Tensor],
    key: str,
    cfg: config.Config,
) -> Any:
    runs: list[tuple[str, Callable[[], Any]]] = []
    for spec, fn in plan.paths:
        if op._call_reasons(spec, kind, call, tensors):
            return STATIC  # not every competitor can take this call: time a later one
        runs.append((spec.name, functools.partial(fn, op, call)))
    if NATIVE in plan.competitors:
        runs.append((NATIVE, functools.partial(invoke, type(op)._native, op, call)))
    # The static choice (what DITOPS_TUNE=off takes: static preferences count) runs first
    # and its output is this call's result.
    _deciding.on = False
    try:
        static = next(
            (s for s, _ in plan.paths if not op._call_reasons(s, kind, call, tensors)), None
        )
    finally:
        _deciding.on = True
    name = static.name if static is not None else NATIVE
    runs.sort(key=lambda r: r[0] != name)
    call.exact = plan.exact
    if static is None:
        result = runs[0][1]()  # the meaning: its errors are the caller's
    else:
        try:
            result = runs[0][1]()
        except Exception as exc:  # noqa: BLE001 - handled as the dispatcher handles it
            return op._after_failure(kind, static, exc, call)
        result = op._mended(static, kind, call, result)
    alive = [runs[0]]
    for name, fn in runs[1:]:  # warm-up (a compiled path compiles here)
        try:
            fn()
            alive.append((name, fn))
        except Exception as exc:  # noqa: BLE001 - a loser; the dispatcher meets it later
            logger.debug("ditops tuning %s: %s raised %r, not timed", key, name, exc)
    best = {name: math.inf for name, _ in alive}
    for r in range(ROUNDS):
        for name, fn in alive if r % 2 == 0 else alive[::-1]:
            _sync(kind)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - raised once timed: it loses, the call goes on
                best[name] = math.inf
                alive = [a for a in alive if a[0] != name]
                continue
            _sync(kind)
            best[name] = min(best[name], time.perf_counter() - t0)
    static = runs[0][0]
    winner = min(best, key=best.__getitem__)
    if best[static] <= best[winner] * (1 + KEEP_MARGIN):
        winner = static
    choice = Choice(
        winner,
        plan.competitors,
        {n: round(t * 1e3, 4) for n, t in best.items()},
        round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0,
    )
    with _table.lock:
        _table.choices[key] = choice
    logger.info("ditops tuning %s: %s (%s)", key, winner, choice.why())
    _save(cache_file(cfg))
    return result


# --- kernel launch configs (Triton) --------------------------------------------------------


def _config_name(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))


def launch_config(
    kernel: str,
    kind: str,
    shape: tuple[int, ...],
    configs: list[dict[str, Any]],
    launch: Callable[[dict[str, Any]], None],
) -> None:
    """Launch a kernel with the fastest of ``configs`` for its shape class (``shape``
    bucketed as tensors' dims are), as ``triton.autotune`` does, but keyed on buckets and
    kept in the same cache file, under the same switch.

    ``configs[0]`` is the static choice (``DITOPS_TUNE=off``, or ``cache`` without a
    record). Every config must compute the call's result (within the op's tolerance:
    fast paths only) and ``launch(cfg)`` must be safe to repeat (outputs only written).
    When timing, each config warms up and runs :data:`ROUNDS` timed rounds; the static
    config runs last, so the timed call's outputs are the ones ``off`` would give.
    """
    cfg = config.get()
    if cfg.tune == "off" or len(configs) < 2:
        launch(configs[0])
        return
    names = tuple(_config_name(c) for c in configs)
    key = f"{kernel}/{kind}/config/[{','.join(str(_bucket(d)) for d in shape)}]"
    choice = lookup(key, cfg)
    if choice is not None and choice.winner in names:
        launch(configs[names.index(choice.winner)])
        return
    if cfg.tune != "on":
        launch(configs[0])
        return
    with _table.lock:
        busy = key in _table.busy
        _table.busy.add(key)
    if busy:
        launch(configs[0])
        return
    try:
        best = dict.fromkeys(names, math.inf)
        order = list(range(len(configs)))[::-1]  # the static config last
        for i in order:
            launch(configs[i])  # warm-up: compiles this config
        for r in range(ROUNDS):
            for i in order if r % 2 else order[::-1]:
                _sync(kind)
                t0 = time.perf_counter()
                launch(configs[i])
                _sync(kind)
                best[names[i]] = min(best[names[i]], time.perf_counter() - t0)
        launch(configs[0])
        winner = min(best, key=best.__getitem__)
        if best[names[0]] <= best[winner] * (1 + KEEP_MARGIN):
            winner = names[0]
        choice = Choice(
            winner,
            names,
            {n: round(t * 1e3, 4) for n, t in best.items()},
            round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0,
        )
        with _table.lock:
            _table.choices[key] = choice
        _save(cache_file(cfg))
    finally:
        with _table.lock:
            _table.busy.discard(key)

"""Choosing among a call's eligible paths by measurement (``DITOPS_TUNE``).

Which path is fastest depends on the machine (AMX or not, AVX-512 or not), on its load
and on the shape, so a fixed order written on one machine is wrong on the next. When
more than one path can serve a call under the precision in force, the dispatcher
(:func:`ditops.core.dispatch.run`) asks this module. The competitors are the op's
usable paths for the device kind that give the call's static choice's bits, the meaning
among them where it gives them and competes (:mod:`ditops.core.same_bits`: timing
never changes a result; with ``torch.use_deterministic_algorithms(True)`` nothing is
tuned).

**Shape classes.** Calls are bucketed by device kind, precision, and each tensor's dtype
and dims rounded to the nearest power of two (``bfloat16[0,13,11]``: ``[1, 8064, 1536]``),
so a model's calls make a handful of classes and a class is timed once.

**Timing** (``on``), on the first call of a class: the static choice (what ``off``
takes) runs first and its output is the call's result; each other competitor warms up
once (a compiled path compiles here), then timed rounds (:data:`ROUNDS`) run them all in
alternating order (a busy neighbour weighs on all alike); the fastest by its best round
wins, the static choice unless beaten by :data:`KEEP_MARGIN`. Cost, once per class and
machine: ``n - 1`` warm-ups and ``ROUNDS * n`` to ``MAX_ROUNDS * n`` timed calls for
``n`` competitors. Calls not every competitor takes (NaN inputs, grad enabled), calls of
a class another thread is timing and traced calls (``torch.compile``) time nothing.

**Memory and the cache.** Choices live in this process and in a JSON file per machine
fingerprint (:func:`fingerprint`) under ``DITOPS_CACHE_DIR``, else
``$XDG_CACHE_HOME/ditops``, else ``~/.cache/ditops`` (:mod:`ditops.core.tune_store`: a
format version, the load per core each choice was timed under, pruning; a bad cache
never breaks a run). ``cache`` mode reads them and times nothing. A record whose
competitors differ from today's, or timed under much heavier load than now, is timed
again (``on``). A winner that raises later falls back as any path does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ditops import config
from ditops.core import registry, same_bits, tune_store
from ditops.core.tune_cache import CPU_FLAGS, Choice, cache_file, cpu_flags, fingerprint
from ditops.core.tune_devices import sync_device

__all__ = ["CPU_FLAGS", "Choice", "cache_file", "cpu_flags", "fingerprint"]
from ditops.core.calls import OpCall
from ditops.core.checks import dtype_name
from ditops.core.declared import Declared
from ditops.core.fallback import after_failure, mended, run_meaning, run_path
from ditops.core.paths import NATIVE
from ditops.core.plan import Plan, call_reasons

logger = logging.getLogger("ditops")

#: Timed rounds per competitor after one warm-up each: ROUNDS, then more while a round
#: still makes one markedly faster (:func:`_settling`), up to MAX_ROUNDS and SETTLE_SECONDS.
#: A big op's first calls pay for fresh pages: at FLUX's bf16 [4608, 3072] the meaning of
#: adaln_residual ran its first five at 2-5x its steady 4.5 ms, and two rounds kept a
#: kernel that runs at 0.65x the meaning once both are warm.
ROUNDS, MAX_ROUNDS, SETTLE_SECONDS = 2, 8, 2.0
SETTLE_GAIN, SETTLE_MIN_S = 0.1, 1e-3
#: The static choice stays unless another competitor is faster by this fraction.
KEEP_MARGIN = 0.03
#: Returned by :func:`dispatch` when the static choice should run (nothing tuned applies).
STATIC = object()


class _Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.choices: dict[str, Choice] = {}
        self.read: set[Path] = set()  # cache files already read
        self.memory_only: set[Path] = set()  # files never to write (said so in a warning)
        self.busy: set[str] = set()  # classes being timed now
        self.classes: dict[tuple[Any, ...], str] = {}  # (dtype, shape)... -> class text
        self.load_checked: set[str] = set()  # cached choices whose load was compared
        self.warned = False


_table = _Table()
_deciding = threading.local()


def deciding() -> bool:
    """Whether the calling thread is inside the tuner's choice (timing or applying a
    tuned winner). A path's static preference (a rule written from other machines'
    measurements, such as "compiled FlexAttention only with AMX") is a reason only
    outside it: measurement replaces it."""
    return getattr(_deciding, "on", False)


def bucket(n: int) -> int:
    """A dim's shape-class bucket: its power of two, rounded."""
    return round(math.log2(n)) if n > 0 else -1


def shape_class(tensors: list[torch.Tensor]) -> str:
    """The bucket of a call's tensors: dtype and dims rounded to powers of two."""
    raw = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    text = _table.classes.get(raw)
    if text is None:
        text = " ".join(
            f"{dtype_name(dt)}[{','.join(str(bucket(d)) for d in shape)}]" for dt, shape in raw
        )
        if len(_table.classes) < 4096:  # bounded: odd shapes do not grow it forever
            _table.classes[raw] = text
    return text


def class_key(op: str, kind: str, precision: str, tensors: list[torch.Tensor]) -> str:
    return f"{op}/{kind}/{precision}/{shape_class(tensors)}"


def _warn(message: str) -> None:
    if not _table.warned:
        _table.warned = True
        logger.warning("ditops tuning: %s", message)


def _load(path: Path) -> None:
    """Read a cache file once per process (a bad one is warned about and ignored)."""
    if path in _table.read:
        return
    _table.read.add(path)
    found = tune_store.read(path)
    if not found.writable:
        _table.memory_only.add(path)
    if found.problem:
        memory = " (choices kept in memory only)" if not found.writable else ""
        _warn(found.problem + memory)
    for key, choice in found.choices.items():
        _table.choices.setdefault(key, choice)


def _save(path: Path | None) -> None:
    """Merge this process's measured choices into the cache file (atomic replace)."""
    if path is None or path in _table.memory_only:
        return
    with _table.lock:
        mine = {k: c for k, c in _table.choices.items() if c.source == "measured"}
    try:
        tune_store.write(path, mine)
    except OSError as exc:
        _table.memory_only.add(path)
        _warn(f"cannot write {path}: {exc} (choices kept in memory only)")


def _file(cfg: config.Config) -> Path | None:
    """This machine's cache file, or None when its folder cannot be named (warned)."""
    try:
        return cache_file(cfg)
    except OSError as exc:
        _warn(f"{exc} (choices kept in memory only)")
        return None


def lookup(key: str, cfg: config.Config | None = None) -> Choice | None:
    """The choice for a class key (reading the cache file on first use)."""
    cfg = cfg or config.get()
    path = _file(cfg)
    if path is not None and path not in _table.read:
        with _table.lock:
            _load(path)
    return _table.choices.get(key)


@contextlib.contextmanager
def retiming(cfg: config.Config | None = None) -> Iterator[None]:
    """Inside: every class met is timed again (``ditops tune --force``): the cache file
    is not read and the choices in memory are forgotten; the new ones are merged in."""
    forget()
    path = _file(cfg or config.get())
    if path is not None:
        _table.read.add(path)
    try:
        yield
    finally:
        if path is not None:
            _table.read.discard(path)


def clear(cfg: config.Config | None = None) -> tuple[Path | None, list[Path]]:
    """Forget every choice and remove this machine's cache file (``ditops tune
    --clear``): the file, and what was removed."""
    forget()
    path = _file(cfg or config.get())
    return path, (tune_store.clear(path) if path is not None else [])


def choices(cfg: config.Config | None = None) -> dict[str, Choice]:
    """Every choice known: this process's and the cache file's (for ``ditops info``)."""
    lookup("", cfg)
    with _table.lock:
        return dict(sorted(_table.choices.items()))


def forget() -> None:
    """Forget every choice in memory (the cache file stays); for tests and ``ditops tune``."""
    with _table.lock:
        _table.choices.clear()
        _table.read.clear()
        _table.memory_only.clear()
        _table.load_checked.clear()
        _table.warned = False


def recorded(op: Declared, kind: str, plan: Plan, call: OpCall) -> Choice | None:
    """The choice that applies to this call's class, if one is recorded (for
    explanations: nothing is timed)."""
    tensors = call.tensors()
    if same_bits.deterministic() or _static_name(op, kind, plan, call, tensors) not in (
        plan.competitors
    ):
        return None
    key = class_key(op.op_name, kind, plan.decision.precision, tensors)
    return same_bits.applicable(lookup(key), plan.competitors, config.get().tune)


def _static_name(
    op: Declared, kind: str, plan: Plan, call: OpCall, tensors: list[torch.Tensor]
) -> str:
    """The path ``DITOPS_TUNE=off`` takes for this call (static preferences count)."""
    outer = deciding()
    _deciding.on = False
    try:
        for spec, _ in plan.paths:
            if not call_reasons(op, spec, kind, call, tensors):
                return spec.name
        return NATIVE
    finally:
        _deciding.on = outer


def dispatch(op: Declared, kind: str, plan: Plan, call: OpCall, tensors: list[torch.Tensor]) -> Any:
    """Run the call on its class's tuned winner, or time the competitors (``on``) on an
    untuned class; :data:`STATIC` when the static choice should run instead."""
    outer = deciding()  # a path may call another op
    _deciding.on = True
    try:
        return _dispatch(op, kind, plan, call, tensors)
    finally:
        _deciding.on = outer


def _dispatch(
    op: Declared, kind: str, plan: Plan, call: OpCall, tensors: list[torch.Tensor]
) -> Any:
    if same_bits.deterministic():
        return STATIC
    static = _static_name(op, kind, plan, call, tensors)
    if static not in plan.competitors:  # its bits are its own: nothing to choose
        return STATIC
    cfg = config.get()
    key = class_key(op.op_name, kind, plan.decision.precision, tensors)
    choice = same_bits.applicable(lookup(key, cfg), plan.competitors, cfg.tune)
    if choice is not None and cfg.tune == "on" and _heavier_then(key, choice):
        choice = None  # timed under much heavier load than now: timed again
    if choice is not None:
        return _run_winner(op, kind, plan, call, tensors, choice.winner)
    if cfg.tune != "on":
        return STATIC
    with claimed(key) as mine:
        return _measure(op, kind, plan, call, tensors, key, cfg, static) if mine else STATIC


@contextlib.contextmanager
def claimed(key: str) -> Iterator[bool]:
    """Whether this thread is the one to time class ``key`` (no other thread is timing
    it); the class stays claimed until the end of the block."""
    with _table.lock:
        mine = key not in _table.busy
        _table.busy.add(key)
    try:
        yield mine
    finally:
        if mine:
            with _table.lock:
                _table.busy.discard(key)


def _heavier_then(key: str, choice: Choice) -> bool:
    """A cached choice timed under much heavier load than now (checked once a class)."""
    if choice.source != "cache" or key in _table.load_checked:
        return False
    _table.load_checked.add(key)
    return tune_store.timed_under_heavier_load(choice)


def _run_winner(
    op: Declared, kind: str, plan: Plan, call: OpCall, tensors: list[torch.Tensor], name: str
) -> Any:
    if name == NATIVE:
        return run_meaning(op, call)
    for spec, fn in plan.paths:
        if spec.name == name:
            if call_reasons(op, spec, kind, call, tensors):
                return STATIC
            call.exact = plan.exact
            return run_path(op, kind, spec, fn, call)
    return STATIC  # not usable any more (broken, disabled): the static walk


def _measure(
    op: Declared,
    kind: str,
    plan: Plan,
    call: OpCall,
    tensors: list[torch.Tensor],
    key: str,
    cfg: config.Config,
    name: str,
) -> Any:
    runs: list[tuple[str, Callable[[], Any]]] = []
    for spec, fn in plan.paths:
        if spec.name not in plan.competitors:
            continue
        if call_reasons(op, spec, kind, call, tensors):
            return STATIC  # not every competitor can take this call: time a later one
        runs.append((spec.name, functools.partial(fn, op, call)))
    if NATIVE in plan.competitors:
        runs.append((NATIVE, functools.partial(run_meaning, op, call)))
    # The static choice (``name``: what DITOPS_TUNE=off takes, static preferences
    # count) runs first and its output is this call's result.
    static = next((s for s, _ in plan.paths if s.name == name), None)
    runs.sort(key=lambda r: r[0] != name)
    call.exact = plan.exact
    if static is None:
        result = runs[0][1]()  # the meaning: its errors are the caller's
    else:
        try:
            result = runs[0][1]()
        except Exception as exc:  # noqa: BLE001 - handled as the dispatcher handles it
            return after_failure(op, kind, static, exc, call)
        result = mended(op, static, kind, call, result)
    best = race(tensors[0].device if tensors else None, key, runs, warmed=1)
    decide(key, runs[0][0], plan.competitors, best, cfg)
    return result


def race(
    device: torch.device | None, key: str, runs: list[tuple[str, Callable[[], Any]]], warmed: int
) -> dict[str, float]:
    """Best seconds of each run over interleaved rounds (alternating order; see
    :data:`ROUNDS`), after one warm-up each (the first ``warmed`` had theirs: a compile
    happens there); a run that raises loses (inf) and the call goes on."""
    alive = list(runs[:warmed])
    for name, fn in runs[warmed:]:
        try:
            fn()
            alive.append((name, fn))
        except Exception as exc:  # noqa: BLE001 - a loser; the dispatcher meets it later
            logger.debug("ditops tuning %s: %s raised %r, not timed", key, name, exc)
    best = {name: math.inf for name, _ in runs}
    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        settling = False
        for name, fn in alive if r % 2 == 0 else alive[::-1]:
            if device is not None:  # the tensors' own device (ditops.core.tune_devices)
                sync_device(device)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - raised once timed: it loses
                best[name] = math.inf
                alive = [a for a in alive if a[0] != name]
                continue
            if device is not None:
                sync_device(device)
            took = time.perf_counter() - t0
            settling = settling or _settling(best[name], took)
            best[name] = min(best[name], took)
        if r + 1 >= ROUNDS and (not settling or time.perf_counter() - start > SETTLE_SECONDS):
            break
    return best


def _settling(best: float, took: float) -> bool:
    """A timed call beat its competitor's best so far by SETTLE_GAIN and SETTLE_MIN_S."""
    return best < math.inf and best - took > max(SETTLE_GAIN * took, SETTLE_MIN_S)


def decide(
    key: str, static: str, candidates: tuple[str, ...], best: dict[str, float], cfg: config.Config
) -> None:
    """Record the fastest (the static choice unless beaten by :data:`KEEP_MARGIN`)."""
    winner = min(best, key=best.__getitem__)
    if best[static] <= best[winner] * (1 + KEEP_MARGIN):
        winner = static
    times = {n: round(t * 1e3, 4) for n, t in best.items() if t < math.inf}
    choice = Choice(winner, candidates, times, tune_store.load_per_core())
    with _table.lock:
        _table.choices[key] = choice
    logger.info("ditops tuning %s: %s (%s)", key, winner, choice.why())
    _save(_file(cfg))


registry.on_reset(forget)

"""Choosing among a call's eligible paths by measurement (``DITOPS_TUNE``).

Which path is fastest depends on the machine (AMX or not, AVX-512 or not), on its load
and on the shape, so a fixed order written on one machine is wrong on the next. When
more than one path can serve a call under the precision in force, the dispatcher
(:func:`ditops.core.dispatch.run`) asks this module. The competitors are the op's
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
timed rounds (:data:`ROUNDS`) run every competitor in alternating order (interleaved, so a
busy neighbour weighs on all alike), and the fastest by its best round wins. The static
choice is kept unless another is faster by :data:`KEEP_MARGIN`. Cost, once per class
and machine: ``n - 1`` warm-ups and ``ROUNDS * n`` to ``MAX_ROUNDS * n`` timed calls for
``n`` competitors (5 to 17 extra calls for a path against the meaning; for CPU
FlexAttention its compile, some seconds, plus about six attention calls). Calls whose
competitors are not all usable on this call (NaN inputs, grad enabled) and calls of a
class another thread is timing take the static choice and time nothing. Never inside
``torch.compile`` tracing (a traced call keeps the static choice: the dispatcher does not
come here then).

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
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ditops import config
from ditops.core import registry
from ditops.core.tune_cache import CPU_FLAGS, Choice, cache_file, cpu_flags, fingerprint

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


def report(cfg: config.Config | None = None) -> tuple[dict[str, Any], list[str]]:
    """The tuning state for ``ditops info`` and ``ditops bench``: JSON-able, and lines."""
    cfg = cfg or config.get()
    found = choices(cfg) if cfg.tune != "off" else {}
    data = {
        "mode": cfg.tune,
        "fingerprint": fingerprint(),
        "cache_file": str(cache_file(cfg)),
        "choices": {k: {"winner": c.winner, "why": c.why()} for k, c in found.items()},
    }
    lines = [
        f"tuned choices (DITOPS_TUNE={cfg.tune}; where several paths can serve a call, the "
        "fastest measured for its shape class, dtypes and dims rounded to powers of two; "
        f"cache {data['cache_file']}):",
        *(describe(found) if cfg.tune != "off" else ["  (off: the static order)"]),
    ]
    return data, lines


def forget() -> None:
    """Forget every choice in memory (the cache file stays); for tests and ``ditops tune``."""
    with _table.lock:
        _table.choices.clear()
        _table.read.clear()
        _table.warned = False


def recorded(op: Declared, kind: str, plan: Plan, call: OpCall) -> Choice | None:
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
) -> Any:
    runs: list[tuple[str, Callable[[], Any]]] = []
    for spec, fn in plan.paths:
        if call_reasons(op, spec, kind, call, tensors):
            return STATIC  # not every competitor can take this call: time a later one
        runs.append((spec.name, functools.partial(fn, op, call)))
    if NATIVE in plan.competitors:
        runs.append((NATIVE, functools.partial(run_meaning, op, call)))
    # The static choice (what DITOPS_TUNE=off takes: static preferences count) runs first
    # and its output is this call's result.
    _deciding.on = False
    try:
        static = next(
            (s for s, _ in plan.paths if not call_reasons(op, s, kind, call, tensors)), None
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
            return after_failure(op, kind, static, exc, call)
        result = mended(op, static, kind, call, result)
    best = _race(kind, key, runs, warmed=1)
    _decide(key, runs[0][0], plan.competitors, best, cfg)
    return result


def _race(
    kind: str, key: str, runs: list[tuple[str, Callable[[], Any]]], warmed: int
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
            _sync(kind)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - raised once timed: it loses
                best[name] = math.inf
                alive = [a for a in alive if a[0] != name]
                continue
            _sync(kind)
            took = time.perf_counter() - t0
            settling = settling or _settling(best[name], took)
            best[name] = min(best[name], took)
        if r + 1 >= ROUNDS and (not settling or time.perf_counter() - start > SETTLE_SECONDS):
            break
    return best


def _settling(best: float, took: float) -> bool:
    """A timed call beat its competitor's best so far by SETTLE_GAIN and SETTLE_MIN_S."""
    return best < math.inf and best - took > max(SETTLE_GAIN * took, SETTLE_MIN_S)


def _decide(
    key: str, static: str, candidates: tuple[str, ...], best: dict[str, float], cfg: config.Config
) -> None:
    """Record the fastest (the static choice unless beaten by :data:`KEEP_MARGIN`)."""
    winner = min(best, key=best.__getitem__)
    if best[static] <= best[winner] * (1 + KEEP_MARGIN):
        winner = static
    times = {n: round(t * 1e3, 4) for n, t in best.items() if t < math.inf}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    choice = Choice(winner, candidates, times, round(load, 2))
    with _table.lock:
        _table.choices[key] = choice
    logger.info("ditops tuning %s: %s (%s)", key, winner, choice.why())
    _save(cache_file(cfg))


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
        runs = [(n, functools.partial(launch, c)) for n, c in zip(names, configs, strict=True)]
        best = _race(kind, key, runs[::-1], warmed=0)  # the static config warms up last
        launch(configs[0])  # ... and runs last: its outputs are the call's
        _decide(key, names[0], names, best, cfg)
    finally:
        with _table.lock:
            _table.busy.discard(key)


registry.on_reset(forget)

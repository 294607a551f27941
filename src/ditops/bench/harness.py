"""The benchmark harness behind ``ditops bench``: timing, ratios, progress, reports.

A suite yields :class:`Case` objects: one input shape, several *variants* computing the
same thing (``native``, ``compile``, ``exact``, ``fast``, ...) and a ``clone`` of the same
bytes (the memory roofline). Every variant of a case is timed in the same run, so the
report gives ratios (speedup over native, over ``torch.compile``, fraction of the clone's
bandwidth) rather than lone absolute times, which on shared machines mean little.

On CPU the speed of kernels that allocate per block of rows depends on glibc's malloc
state (see :mod:`ditops.kernels.cpu.blocks`), which is fixed for a process at start-up:
rows carry the state they were measured in (``malloc``: ``grows``, glibc's default, where
the mmap threshold grows after large frees, or ``fixed``), and ``ditops bench`` re-runs
such suites in a child process in the other state (:func:`malloc_env`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from ditops._version import __version__
from ditops.core.checks import positive_seconds
from ditops.platform import cpu_flags


@dataclass
class Case:
    """One benchmarked shape: named variants that compute the same result."""

    suite: str
    name: str
    variants: dict[str, Callable[[], Any]]
    #: bytes a single pass must read and write (for GB/s); 0 when not meaningful.
    bytes_moved: int = 0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    suite: str
    case: str
    variant: str
    median_s: float
    min_s: float
    reps: int
    params: dict[str, Any]
    bytes_moved: int = 0
    error: str = ""
    cpu_s: float = float("nan")

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.median_s / 1e9 if self.bytes_moved and self.median_s else 0.0


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` to finish (nothing to wait for on CPU), so
    that a wall-clock reading after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)  # type: ignore[attr-defined]
    elif device.type != "cpu":  # an Ascend NPU (torch_npu) and other accelerators
        torch.accelerator.synchronize(device)


def time_call(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 2,
    min_reps: int = 5,
    min_seconds: float = 0.5,
    max_reps: int = 200,
) -> tuple[float, float, int, float]:
    """Median and minimum seconds of ``fn()``, after ``warmup`` calls (compiles, caches),
    the number of calls timed, and the median CPU seconds of a call (user + system, all
    threads of the process: on a shared machine the wall time mostly measures waiting for
    a core, the CPU time what the call did)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    cpu: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (
        time.perf_counter() - start < min_seconds and len(times) < max_reps
    ):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), min(times), len(times), statistics.median(cpu)


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of each of ``fns`` over ``rounds`` rounds, each round calling every
    one once in turn (on a shared machine, load that comes and goes then hits all of
    them alike: compare within one round, or medians of ratios)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


class Progress:
    """A progress bar on stderr (tqdm when installed, plain lines otherwise)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar: Any = None
        self._n = 0
        self._total = total
        self._desc = desc
        self._enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self._bar = None
            else:
                self._bar = tqdm(
                    total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True
                )

    def step(self, label: str) -> None:
        self._n += 1
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        else:
            print(f"[{self._n}/{self._total}] {self._desc}: {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_cases(
    cases: Iterable[Case],
    device: torch.device,
    *,
    n_steps: int,
    desc: str,
    progress: bool = True,
    min_seconds: float = 0.5,
) -> Iterator[Result]:
    """Time every variant of every case, yielding results as they come."""
    bar = Progress(n_steps, desc, progress)
    try:
        for case in cases:
            for variant, fn in case.variants.items():
                bar.step(f"{case.name} {variant}")
                try:
                    med, best, reps, cpu = time_call(fn, device, min_seconds=min_seconds)
                    error = ""
                except Exception as exc:  # noqa: BLE001 - one failing variant must not end the run
                    med, best, reps, cpu = float("nan"), float("nan"), 0, float("nan")
                    error = f"{type(exc).__name__}: {exc}"
                yield Result(
                    case.suite,
                    case.name,
                    variant,
                    med,
                    best,
                    reps,
                    case.params,
                    case.bytes_moved,
                    error,
                    cpu,
                )
    finally:
        bar.close()


def variants_by_case(rows: list[dict[str, Any]], suite: str) -> dict[str, dict[str, Any]]:
    """``{case: {variant: row}}`` of ``suite``'s :func:`ratios` rows, in their order."""
    by_case: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["suite"] == suite:
            by_case.setdefault(row["case"], {})[row["variant"]] = row
    return by_case


def ratios(
    results: list[Result],
    baseline: str = "native",
    roofline: str = "clone",
    malloc: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (case, variant): time, speedup over ``baseline`` and ``compile``, and
    the fraction of the roofline's bandwidth (roofline time / variant time); ``malloc``
    is the allocator state they were measured in (None where it does not apply)."""
    by_case: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        by_case.setdefault((r.suite, r.case), {})[r.variant] = r
    rows = []
    for (suite, case), variants in by_case.items():
        base = variants.get(baseline)
        comp = variants.get("compile")
        roof = variants.get(roofline)
        for name, r in variants.items():
            row: dict[str, Any] = {
                "suite": suite,
                "case": case,
                "variant": name,
                "median_ms": r.median_s * 1e3,
                "min_ms": r.min_s * 1e3,
                "cpu_ms": r.cpu_s * 1e3,
                "reps": r.reps,
                "gbps": r.gbps,
                "vs_native": base.median_s / r.median_s if base else None,
                "vs_native_cpu": base.cpu_s / r.cpu_s if base and r.cpu_s else None,
                "vs_compile": comp.median_s / r.median_s if comp else None,
                "of_clone_bw": roof.median_s / r.median_s if roof and r.bytes_moved else None,
                "error": r.error,
                "malloc": malloc,
                **{f"p_{k}": v for k, v in r.params.items()},
            }
            rows.append(row)
    return rows


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return format("-", ">" + spec.split(".")[0])
    return format(v, spec)


def print_table(rows: list[dict[str, Any]], out: TextIO | None = None) -> None:
    """A plain-text table of :func:`ratios` rows (on stdout by default)."""
    out = out or sys.stdout
    header = (
        f"{'case':<28} {'variant':<10} {'ms':>9} {'GB/s':>7} "
        f"{'x native':>9} {'x compile':>10} {'of clone':>9} {'cpu ms':>9} {'x nat cpu':>9}"
    )
    section = None
    for row in rows:
        malloc = row.get("malloc")
        if (row["suite"], malloc) != section:
            section = (row["suite"], malloc)
            where = f"  (malloc: {malloc}, {MALLOC_STATES[malloc]})" if malloc else ""
            print(f"\n== {row['suite']}{where}", file=out)
            print(header, file=out)
        line = (
            f"{row['case']:<28} {row['variant']:<10} {_fmt(row['median_ms'], '9.2f')} "
            f"{_fmt(row['gbps'] or None, '7.1f')} {_fmt(row['vs_native'], '9.2f')} "
            f"{_fmt(row['vs_compile'], '10.2f')} {_fmt(row['of_clone_bw'], '9.2f')} "
            f"{_fmt(row.get('cpu_ms'), '9.2f')} {_fmt(row.get('vs_native_cpu'), '9.2f')}"
        )
        if row["error"]:
            line += f"  ERROR {row['error'][:80]}"
        print(line, file=out)


def print_malloc_summary(rows: list[dict[str, Any]], out: TextIO | None = None) -> None:
    """Speedup over native of each variant in each malloc state, side by side, by wall
    time and by CPU time (cases measured in more than one state only)."""
    out = out or sys.stdout
    table: dict[tuple[str, str, str], dict[str, tuple[Any, Any]]] = {}
    for row in rows:
        if row.get("malloc") and row["variant"] not in ("native", "clone"):
            key = (row["suite"], row["case"], row["variant"])
            speedups = (row["vs_native"], row.get("vs_native_cpu"))
            table.setdefault(key, {})[row["malloc"]] = speedups
    both = {k: v for k, v in table.items() if len(v) > 1}
    if not both:
        return
    states = list(MALLOC_STATES)
    print("\n== x native in each malloc state (wall time, CPU time)", file=out)
    head = " ".join(f"{s + ' wall':>11} {s + ' cpu':>10}" for s in states)
    print(f"{'suite':<12} {'case':<28} {'variant':<10} {head}", file=out)
    for (suite, case, variant), by_state in both.items():
        cells = " ".join(
            f"{_fmt(by_state.get(s, (None, None))[0], '11.2f')} "
            f"{_fmt(by_state.get(s, (None, None))[1], '10.2f')}"
            for s in states
        )
        print(f"{suite:<12} {case:<28} {variant:<10} {cells}", file=out)


# --- glibc malloc states -----------------------------------------------------------------

#: glibc reads it at start-up; once set the mmap threshold stays put (no growth).
MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"
#: glibc's starting threshold, 128 KiB
MALLOC_FIXED = "131072"
MALLOC_STATES = {
    "grows": "glibc's default, the mmap threshold grows after large frees",
    "fixed": f"{MALLOC_ENV}={MALLOC_FIXED}, the threshold stays at its starting 128 KiB",
}
#: glibc tunables that, like the variable, switch the threshold's growth off
_FIXING_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")


def malloc_state(environ: dict[str, str] | None = None) -> str:
    """``fixed`` when the process was started with the mmap threshold set (by the
    variable or a glibc tunable), else ``grows``."""
    env = os.environ if environ is None else environ
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(MALLOC_ENV) or any(f"malloc.{t}=" in tunables for t in _FIXING_TUNABLES):
        return "fixed"
    return "grows"


def malloc_env(state: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment that starts a process in malloc ``state``."""
    env = dict(os.environ if environ is None else environ)
    env.pop(MALLOC_ENV, None)
    tunables = [
        t
        for t in env.pop("GLIBC_TUNABLES", "").split(":")
        if t and not any(t.startswith(f"glibc.malloc.{f}=") for f in _FIXING_TUNABLES)
    ]
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    if state == "fixed":
        env[MALLOC_ENV] = MALLOC_FIXED
    elif state != "grows":
        raise ValueError(f"malloc state must be one of {sorted(MALLOC_STATES)}, got {state!r}")
    return env


def run_child(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` (a ``ditops bench`` writing JSON) with ``env``; its stdout (a table the
    parent prints itself) is dropped, its stderr (progress, errors) shown. Exit status."""
    return subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=False).returncode


def cpu_features() -> str:
    """What this CPU gives torch's kernels: its capability and AVX-512 / AMX, in words.

    Timings move with these: dense SDPA runs much faster with AMX (the ``native`` rows of
    benchmarks/cpu/attention.txt, recorded with AMX, and of attention-avx2.txt, without);
    without AVX-512, bf16 matmuls take a slow fallback.
    """
    flags = cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    if not flags:
        return f"torch CPU capability {capability}"
    avx512 = "AVX-512" + (" with bf16" if "avx512_bf16" in flags else "")
    return (
        f"torch CPU capability {capability}, "
        f"{avx512 if 'avx512f' in flags else 'no AVX-512'}, "
        f"{'AMX' if 'amx_tile' in flags else 'no AMX'}"
    )


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "ditops": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_features": cpu_features(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "malloc": malloc_state() if device.type == "cpu" else None,
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def write_run_json(
    path: str, device: torch.device, prog: str, argv: list[str] | None, **fields: Any
) -> None:
    """Write ``fields`` to ``path`` as JSON after the machine (:func:`machine_info`) and
    the command line (``prog`` and ``argv``, None: this process's arguments)."""
    command = " ".join([prog, *(argv or sys.argv[1:])])
    write_json(path, {"machine": machine_info(device), "command": command, **fields})


def case_suite_parser(prog: str, sizes: Iterable[str]) -> argparse.ArgumentParser:
    """The arguments of a suite's own ``python -m`` entry: ``--size`` (one of ``sizes``),
    ``--dtype``, ``--device``, ``--json``, ``--min-seconds``, ``--no-progress``."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--size", choices=tuple(sizes), default="small")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--min-seconds", type=positive_seconds, default=0.5)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def run_suite_cases(
    args: argparse.Namespace,
    cases: Callable[[torch.device, str, torch.dtype], Iterable[Case]],
    steps: Callable[[str], int],
    desc: str,
) -> list[Result]:
    """A suite's cases at ``args``' size, dtype and device (:func:`case_suite_parser`),
    every variant timed (:func:`run_cases`)."""
    device = torch.device(args.device)
    return list(
        run_cases(
            cases(device, args.size, getattr(torch, args.dtype)),
            device,
            n_steps=steps(args.size),
            desc=desc,
            progress=not args.no_progress,
            min_seconds=args.min_seconds,
        )
    )


def results_as_dicts(results: list[Result]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]

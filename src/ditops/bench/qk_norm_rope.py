"""Benchmark suite ``qk_norm_rope``: the attention prologue (RMSNorm of q and k, rotary
embedding) against eager, at Wan's and FLUX's shapes.

Cases (bf16 q and k ``[1, L, H, 128]``, norm weights in bf16 as the models hold them,
fp32 rope tables of one angle per pair, eps 1e-6):

* ``wan``: ``[1, 8192, 12, 128]`` (Wan 1.3B at 480p), the norm across heads
  (``torch.nn.RMSNorm(H * 128)``), interleaved pairs; ``full`` adds Wan 14B's 40 heads;
* ``flux``: ``[1, 4608, 24, 128]`` (FLUX at 1024x1024: 4096 image + 512 text tokens),
  the norm per head, interleaved pairs (``use_real_unbind_dim=-1``).

Variants, all timed in one run: ``native`` (``forward_native``: the eager code, norm then
``x * cos + rotate(x) * sin`` as diffusers writes it), ``compile`` (``torch.compile`` of
it), ditops ``exact`` and ``fast`` (the path the dispatcher picks on this device), and
``clone``: a copy of the bytes the op must move (read q and k, write both; the tables
and weights are 1/H of that and come from cache), the memory roofline.

Targets on CPU (issue 12): exact >= 3x native, fast >= 1.0x compile and >= 0.7 of the
clone's bandwidth; :func:`summary` checks them.

``ditops bench qk_norm_rope`` times the variants one after another (the harness's way).
On a shared machine whose load moves within seconds that skews ratios, so
``python -m ditops.bench.qk_norm_rope`` times them interleaved instead: every round runs
each variant once (in a rotating order), and each ratio is the median of the per-round
ratios, which cancels load that drifts slower than a round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ditops import config
from ditops.bench.harness import Case, Result, variants_by_case
from ditops.bench.suite import Suite
from ditops.ops.qk_norm_rope import qk_norm_rope

HEAD_DIM = 128
EPS = 1e-6
#: (name, L, H, norm across heads)
SHAPES = {
    "small": (("wan", 8192, 12, True), ("flux", 4608, 24, False)),
    "full": (("wan", 8192, 12, True), ("flux", 4608, 24, False), ("wan14b", 8192, 40, True)),
}
VARIANTS = ("native", "compile", "exact", "fast", "clone")


def _case(
    name: str, L: int, H: int, across: bool, device: torch.device, compiled: Callable[..., Any]
) -> Case:
    gen = torch.Generator().manual_seed(L * H)

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale + shift

    q = rand(1, L, H, HEAD_DIM).to(device, torch.bfloat16)
    k = rand(1, L, H, HEAD_DIM).to(device, torch.bfloat16)
    n = H * HEAD_DIM if across else HEAD_DIM
    wq = rand(n, scale=0.3, shift=1.0).to(device, torch.bfloat16)
    wk = rand(n, scale=0.3, shift=1.0).to(device, torch.bfloat16)
    angle = torch.rand(L, HEAD_DIM // 2, generator=gen) * 6.28
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    args = (q, k, wq, wk, cos, sin, EPS)

    def native() -> Any:
        with torch.inference_mode():
            return qk_norm_rope.op.forward_native(
                *args, across_heads=across, layout="interleaved", convention="torch"
            )

    def compile_() -> Any:
        with torch.inference_mode():
            return compiled(*args, across)

    def ditops(precision: str) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode(), config.override(precision=precision):
                return qk_norm_rope(*args, across_heads=across)

        return run

    moved = 4 * q.numel() * q.element_size()
    # Written once, so its pages are real memory (see the modulation suite).
    roof = torch.ones(moved // 2, dtype=torch.uint8, device=device)
    variants = dict(zip(VARIANTS, (native, compile_, ditops("exact"), ditops("fast"), roof.clone)))
    return Case(
        suite="qk_norm_rope",
        name=f"{name} {L}x{H}x{HEAD_DIM}",
        variants=variants,
        bytes_moved=moved,
        params={
            "model": name,
            "L": L,
            "H": H,
            "D": HEAD_DIM,
            "norm": "across heads" if across else "per head",
            "dtype": "bfloat16",
        },
    )


def _meaning(*args: Any) -> Any:
    *rest, across = args
    return qk_norm_rope.op.forward_native(
        *rest, across_heads=across, layout="interleaved", convention="torch"
    )


def cases(device: torch.device, size: str) -> Iterator[Case]:
    compiled = torch.compile(_meaning, dynamic=False)
    for name, L, H, across in SHAPES[size]:
        yield _case(name, L, H, across, device, compiled)


def _steps(size: str) -> int:
    return len(SHAPES[size]) * len(VARIANTS)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, the figures of the issue's CPU targets, from ``harness.ratios`` rows."""
    out = []
    for case, v in variants_by_case(rows, "qk_norm_rope").items():
        exact, fast = v.get("exact", {}), v.get("fast", {})
        s = {
            "case": case,
            "exact_x_native": exact.get("vs_native"),
            "fast_x_compile": fast.get("vs_compile"),
            "fast_of_clone": fast.get("of_clone_bw"),
        }
        s["targets_met"] = {
            "exact >= 3x native": _ge(s["exact_x_native"], 3.0),
            "fast >= 1.0x compile": _ge(s["fast_x_compile"], 1.0),
            "fast >= 0.7 of clone": _ge(s["fast_of_clone"], 0.7),
        }
        out.append(s)
    return out


def _ge(value: float | None, target: float) -> bool | None:
    return None if value is None or value != value else value >= target


def print_summary(summ: list[dict[str, Any]]) -> None:
    print("\n== qk_norm_rope targets (CPU)")
    for s in summ:
        met = ", ".join(
            f"{name}: {'met' if ok else 'not met' if ok is not None else '-'}"
            for name, ok in s["targets_met"].items()
        )
        print(
            f"{s['case']:<24} exact {_fmt(s['exact_x_native'])}x native, fast "
            f"{_fmt(s['fast_x_compile'])}x compile, {_fmt(s['fast_of_clone'])} of clone ({met})"
        )


def _fmt(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.2f}"


def interleaved(case: Case, rounds: int, device: torch.device) -> list[Result]:
    """Time ``case``'s variants in ``rounds`` rounds, each variant once per round (the
    order rotating), after two untimed calls each (compiles, caches). Each ``Result``
    holds the median time; ``ratio_to`` in its params the median per-round ratios."""
    names = list(case.variants)
    for fn in case.variants.values():
        fn()
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            case.variants[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    results = []
    for name in names:
        per_round = {
            other: statistics.median(a / b for a, b in zip(times[other], times[name]))
            for other in names
        }
        params = {**case.params, "ratio_to": per_round}
        ts = times[name]
        results.append(
            Result(
                case.suite,
                case.name,
                name,
                statistics.median(ts),
                min(ts),
                len(ts),
                params,
                case.bytes_moved,
            )
        )
    return results


def interleaved_rows(results: list[Result]) -> list[dict[str, Any]]:
    """``harness.ratios`` rows whose ratios are the medians of per-round ratios."""
    from ditops.bench.harness import ratios

    rows = ratios(results)
    for row in rows:
        per = row.get("p_ratio_to") or {}
        row["vs_native"] = per.get("native")
        row["vs_compile"] = per.get("compile")
        row["of_clone_bw"] = per.get("clone")
        row.pop("p_ratio_to", None)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m ditops.bench.qk_norm_rope``: the suite timed interleaved, targets checked."""
    from ditops.bench.harness import print_table, write_run_json

    parser = argparse.ArgumentParser(prog="python -m ditops.bench.qk_norm_rope")
    parser.add_argument("--size", choices=("small", "full"), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    results: list[Result] = []
    for case in cases(device, args.size):
        print(f"qk_norm_rope: {case.name}, {args.rounds} rounds", file=sys.stderr, flush=True)
        results.extend(interleaved(case, args.rounds, device))
    rows = interleaved_rows(results)
    print_table(rows)
    summ = summary(rows)
    print_summary(summ)
    if args.json:
        write_run_json(
            args.json,
            device,
            "python -m ditops.bench.qk_norm_rope",
            argv,
            timing="interleaved rounds; ratios are medians of per-round ratios",
            rows=rows,
            summary=summ,
        )
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


SUITE = Suite(
    name="qk_norm_rope",
    title="attention prologue: RMSNorm + rotary of q and k, bf16, Wan and FLUX shapes",
    cases=cases,
    steps=_steps,
)


if __name__ == "__main__":
    raise SystemExit(main())

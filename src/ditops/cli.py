"""The ``ditops`` command: ``info`` explains the dispatcher's choices, ``bench`` measures.

ditops info [--json] [--verbose] [--tuned] [--precision fast|exact]
ditops tune [wan] [--size ...] [--precision ...] [--dtype ...] [--device DEV] [--model PATH]
            [--force] | --clear
ditops bench [SUITE ...] [--size small|full] [--dtype auto|bfloat16|float32] [--device DEV]
             [--json PATH] [--no-progress] [--malloc both|current] [--busy]
torchrun --nproc-per-node N -m ditops bench --parallel ulysses|ring|unified [--size ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ditops import config
from ditops._version import __version__
from ditops.bench.suite import glibc, run_in_other_malloc_state
from ditops.core.checks import positive_seconds


def _info(args: argparse.Namespace) -> int:
    from ditops import info

    return info.run(args)


def _tune(args: argparse.Namespace) -> int:
    from ditops.bench.tune_model import cli

    return cli(args, _default_device())


def _bench_argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's arguments (a device that is not there, an output
    that cannot be written), in one line, or None."""
    from ditops.bench.devices import device_problem

    if getattr(args, "json", None) == "":  # '' would silently mean no file
        return "--json is empty; give a file path"
    problem = device_problem(args.device)
    if problem:
        return problem
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if not path:
            continue
        where = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"--{flag} {path} is a directory; give a file path"
        if not os.path.isdir(where):
            return f"--{flag} {path}: the folder {where} does not exist"
        if not os.access(where, os.W_OK):
            return f"--{flag} {path}: the folder {where} is not writable"
    return None


def _bench(args: argparse.Namespace) -> int:
    problem = _bench_argument_problem(args)
    if problem:  # before any benchmark runs: minutes of work never end in a traceback
        print(f"ditops bench: {problem}", file=sys.stderr)
        return 2
    if args.quick:
        return _bench_quick(args)
    if args.parallel:
        return _bench_parallel(args)
    from ditops.bench.load import busy_neighbour

    with busy_neighbour(args.busy):
        return _bench_suites(args)


def _bench_quick(args: argparse.Namespace) -> int:
    """``--quick``: the tiny offline pipelines of :mod:`ditops.bench.quick` (under a minute)."""
    from ditops.bench import quick, tiny

    other = [
        f
        for f, on in (
            ("SUITE", args.suites),
            ("--model", args.model),
            ("--parallel", args.parallel),
        )
        if on
    ]
    if other:  # never silently ignored
        print(
            f"ditops bench --quick runs its own tiny models; drop {', '.join(other)}",
            file=sys.stderr,
        )
        return 2
    try:
        tiny.require("diffusers", "transformers")
    except tiny.MissingPackage as exc:
        print(f"ditops bench --quick: {exc}", file=sys.stderr)
        return 2
    result = quick.run()
    if args.json:
        from ditops.bench.harness import write_json

        write_json(args.json, result)
    return 0 if result["bitwise"]["bitwise_equal"] else 1


def _bench_suites(args: argparse.Namespace) -> int:
    from ditops.bench.harness import (
        machine_info,
        malloc_state,
        print_malloc_summary,
        print_table,
        ratios,
        run_cases,
        write_json,
    )
    from ditops.bench.load import header, load_average
    from ditops.bench.suites import SUITES, get_suite
    from ditops.core import tune, tune_report

    names = args.suites or ["wan"]
    from ditops.bench.model_bench import MODEL_BENCHES

    models = ("wan", *MODEL_BENCHES, "sglang")
    unknown = [n for n in names if n not in SUITES and n not in models]
    if unknown:
        print(
            f"ditops bench: unknown suite(s) {', '.join(unknown)}; "
            f"available: {', '.join(models)}, {', '.join(sorted(SUITES))}",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device) if args.device else _default_device()
    # Every shape of a suite compiles its torch.compile baseline once; past dynamo's
    # default limit of 8 recompiles it would silently run eager and flatter ditops.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    malloc = malloc_state() if device.type == "cpu" else None
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"machine": machine_info(device), "command": " ".join(sys.argv)}
    payload["machine"].update(
        fingerprint=tune.fingerprint(), load_at_start=load_average(), busy_neighbour=args.busy
    )
    for line in header(args.busy):
        print(line)
    for name in names:
        if name == "wan":
            try:
                import diffusers  # noqa: F401 - the wan suite builds a diffusers model
            except ImportError:
                print(
                    "ditops bench: the wan suite needs diffusers: pip install 'ditops[bench]' "
                    "(or run an op suite: ditops bench layer_norm)",
                    file=sys.stderr,
                )
                return 2
            from ditops.bench.wan_model import ModelLoadError

            try:
                payload["wan"] = _bench_wan(args, device)
            except ModelLoadError as exc:  # --model PATH that cannot be loaded
                print(f"ditops bench: {exc}", file=sys.stderr)
                return 2
            continue
        if name == "sglang":  # the bench Wan inside sglang's runtime (needs sglang)
            from ditops.bench import sglang

            dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
            payload[name] = sglang.cli(device, args.size, dtype)
            continue
        if name in MODEL_BENCHES:  # a small diffusers model end to end (bench/model_bench.py)
            import importlib

            dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
            bench = importlib.import_module(f"ditops.bench.{name}")
            payload[name] = bench.cli(device, args.size, not args.no_progress, dtype)
            continue
        suite = get_suite(name)
        where = f", malloc {malloc}" if malloc else ""
        print(
            f"ditops bench: {name} ({suite.title}) on {device}, size {args.size}{where}",
            file=sys.stderr,
        )
        results = run_cases(
            suite.cases(device, args.size),
            device,
            n_steps=suite.steps(args.size),
            desc=name,
            progress=not args.no_progress,
            min_seconds=args.min_seconds,
        )
        rows.extend(ratios(list(results), malloc=malloc))
        if malloc and suite.malloc_states and args.malloc == "both" and glibc():
            rows.extend(run_in_other_malloc_state(args, name, malloc))
    if rows:
        payload["rows"] = rows
        print_table(rows)
        print_malloc_summary(rows)
        if "attention" in names:
            from ditops.bench import attention

            payload["attention_summary"] = attention.summary(rows)
            attention.print_summary(payload["attention_summary"])
        if "masks" in names:
            from ditops.bench import masks

            payload["masks_summary"] = masks.summary(rows)
            masks.print_summary(payload["masks_summary"])
            if args.plot:  # beside the wan suite's plot when both run
                stem, ext = os.path.splitext(args.plot)
                path = f"{stem}-masks{ext or '.png'}" if "wan" in names else args.plot
                masks.plot(payload["masks_summary"], path)
                print(f"wrote {path}", file=sys.stderr)
        if "qk_norm_rope" in names:
            from ditops.bench import qk_norm_rope

            payload["qk_norm_rope_summary"] = qk_norm_rope.summary(payload["rows"])
            qk_norm_rope.print_summary(payload["qk_norm_rope_summary"])
    payload["tuning"], tuning_lines = tune_report.report()
    print("\n" + "\n".join(tuning_lines))
    if args.json:
        write_json(args.json, payload)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


def _bench_parallel(args: argparse.Namespace) -> int:
    """The wan suite under diffusers' context parallelism, one rank per torchrun process."""
    if args.suites and args.suites != ["wan"]:
        print("ditops bench: --parallel runs the wan suite only", file=sys.stderr)
        return 2
    try:
        import diffusers  # noqa: F401 - the wan suite builds a diffusers model
    except ImportError:
        print(
            "ditops bench: --parallel needs diffusers: pip install 'ditops[bench]'", file=sys.stderr
        )
        return 2
    from ditops.bench import parallel
    from ditops.bench.wan_model import ModelLoadError

    try:
        return parallel.main(args)
    except (parallel.LaunchError, ModelLoadError) as exc:
        print(f"ditops bench: {exc}", file=sys.stderr)
        return 2


def _bench_wan(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from ditops.bench import wan
    from ditops.bench.wan_model import cpu_warning, default_dtype
    from ditops.bench.wan_report import print_report
    from ditops.platform import cpu_half_matmuls_slow

    where = f"--model {args.model}" if args.model else "the built-in small Wan config"
    print(f"ditops bench: wan ({where}) on {device}, size {args.size}", file=sys.stderr)
    if args.dtype == "auto":
        dtype = default_dtype(device)
        if dtype != torch.bfloat16:
            print(
                f"ditops bench: --dtype auto chose float32: this CPU (torch capability "
                f"{cpu_half_matmuls_slow()}, no AVX-512) runs bf16 matmuls on a slow fallback; "
                "--dtype bfloat16 measures bf16 anyway (hours)",
                file=sys.stderr,
            )
    else:
        dtype = getattr(torch, args.dtype)
        warning = cpu_warning(device, dtype)
        if warning:
            print(f"ditops bench: {warning}", file=sys.stderr)
    result = wan.run(
        device,
        args.size,
        model_path=args.model,
        progress=not args.no_progress,
        plot_path=WAN_PLOT if args.plot is None else args.plot,
        dtype=dtype,
    )
    print_report(result)
    if args.plot != "":
        print(f"wrote {WAN_PLOT if args.plot is None else args.plot}", file=sys.stderr)
    return result


#: ``ditops --help``'s opening (plain text: argparse prints it as written).
DESCRIPTION = (
    "Fast, portable operators for diffusion-transformer inference. info: which path each op "
    "takes on this machine, and why; bench: measure (bench --quick: a first run in under a "
    "minute); tune: time a model's paths ahead."
)

#: The wan suite's plot when --plot is not given.
WAN_PLOT = "ditops-bench-wan.png"


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditops", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ditops {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="explain which path every op takes on every device kind")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument(
        "--verbose", action="store_true", help="also what each fast path takes (dtypes, ...)"
    )
    info.add_argument(
        "--precision",
        choices=config.PRECISIONS,
        default=None,
        help="explain for this precision (default: DITOPS_PRECISION)",
    )
    info.add_argument(
        "--tuned",
        action="store_true",
        help="also every tuned shape class (op, device kind, precision, dtypes, dims rounded "
        "to powers of two), its winner and the times that chose it",
    )
    from ditops.bench.tune_model import add_arguments

    add_arguments(sub.add_parser("tune", help="time a model's shape classes ahead (DITOPS_TUNE)"))
    bench = sub.add_parser(
        "bench", help="measure ops (and a small Wan model) native against ditops"
    )
    bench.add_argument(
        "suites",
        nargs="*",
        help="wan (the default: a small Wan model end to end), flux (a small FLUX model), "
        "hunyuan_video / ltx_video (a small HunyuanVideo / LTX-Video model, sparse "
        "variants), cogvideox (small CogVideoX 1.0 and 1.5 models, sparse variants), layer_norm, "
        "modulation, attention, masks (the mask estimation methods against oracles), "
        "qk_norm_rope, sglang (the Wan model inside sglang's runtime: stock, ditops dense "
        "and sparse; needs sglang's environment)",
    )
    bench.add_argument(
        "--size",
        choices=("small", "full"),
        default="small",
        help="small: minutes on 2 CPU cores; full: every shape (wan: Wan 480p, "
        "21 latent frames of 30x52 tokens, for GPUs and patient CPU users)",
    )
    bench.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="wan suite and the model benches: the model's dtype (auto: bfloat16, or float32 "
        "on CPUs without AVX-512, where bf16 matmuls are a slow fallback; flux: bfloat16)",
    )
    bench.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="also write results as JSON")
    bench.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help=f"where the wan suite writes its plot (default {WAN_PLOT}; '' for none) and "
        "the masks suite its own (only when given; PNG-masks.png when wan runs too)",
    )
    bench.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="wan suite: a local diffusers WanTransformer3DModel checkpoint (local files only)",
    )
    bench.add_argument(
        "--parallel",
        choices=("ulysses", "ring", "unified"),
        default=None,
        help="wan suite under diffusers' context parallelism, one rank per process: launch "
        "with torchrun --nproc-per-node N -m ditops bench --parallel MODE",
    )
    bench.add_argument(
        "--min-seconds", type=positive_seconds, default=0.5, help="time spent per variant (> 0)"
    )
    bench.add_argument(
        "--busy",
        action="store_true",
        help="run with a busy neighbour: a process spinning on one core for the whole run",
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a first success in under a minute, offline: a tiny pipeline patched (frames "
        "bitwise equal in exact precision), sparse steps' density and speedup, what next",
    )
    bench.add_argument(
        "--malloc",
        choices=("both", "current"),
        default="both",
        help="CPU suites that allocate per block (layer_norm, modulation): also run them in a "
        "child process in the other glibc malloc state (both, the default), or not (current)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"info": _info, "tune": _tune, "bench": _bench}
        code = commands[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try
        return code
    except config.ConfigError as exc:  # a bad DITOPS_* value: one line, not a traceback
        print(f"ditops: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `ditops info | head`: the reader left. Point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``ditops tune``: time a model's shape classes ahead of time (:mod:`ditops.core.tune`).

Builds the ``ditops bench wan`` model (or ``--model PATH``), patches it as the bench does
(the fused norms, block-sparse self-attention at sparsity 0.75) in each precision asked
for, and runs one forward at a sparse step with ``DITOPS_TUNE=on``: every op call whose
shape class has no choice yet times its competitors then (FlexAttention's compile
included), and the choices land in the cache file. Later runs of the same shapes, in any
process on this machine, start from them. ``--force`` times every class met again (the
recorded choices are not read; the new ones replace them in the file); ``--clear``
removes this machine's cache file and times nothing (:mod:`ditops.core.tune_store`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ditops import config
from ditops.core import tune, tune_report


def tune_wan(
    device: torch.device,
    size: str,
    precisions: tuple[str, ...],
    dtype: torch.dtype,
    model_path: str | None = None,
) -> dict[str, tune.Choice]:
    """Tune the bench Wan's shapes; returns the choices measured (class key -> choice)."""
    from ditops.attention import BlockSparseConfig
    from ditops.bench.wan import LATENTS, SKIP_FIRST_STEPS, TEXT_TOKENS
    from ditops.bench.wan_model import build_model, make_inputs
    from ditops.bench.wan_probes import timed_step
    from ditops.integrations import patch, unpatch

    model = build_model(model_path, device, dtype)
    inputs = make_inputs(model.config, LATENTS[size][2:], TEXT_TOKENS, device, dtype)
    steps = torch.linspace(999, 0, 2).round().to(device)
    before = set(tune.choices())
    try:
        for precision in precisions:
            unpatch(model)
            sparse = BlockSparseConfig(sparsity=0.75, skip_first_steps=SKIP_FIRST_STEPS)
            patch(model, precision=precision, attention=sparse)
            with config.override(tune="on"):
                timed_step(
                    model,
                    inputs["hidden_states"],
                    steps,
                    inputs["encoder_hidden_states"],
                    1,  # a sparse step (the bench's configs skip the first)
                    2,
                    device,
                )
    finally:
        unpatch(model)
    return {k: c for k, c in tune.choices().items() if k not in before or c.source == "measured"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ditops tune``'s options, each with its help text."""
    parser.add_argument(
        "model_name",
        nargs="?",
        choices=("wan",),
        default="wan",
        help="the model whose shape classes are timed (wan: the bench Wan model)",
    )
    parser.add_argument(
        "--size",
        choices=("small", "full"),
        default="small",
        help="small: the bench's small latents (minutes on 2 CPU cores); full: Wan 480p",
    )
    parser.add_argument(
        "--precision",
        choices=("exact", "fast", "both"),
        default="both",
        help="the precision(s) to time in (default both: each is a class of its own)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the model's dtype (auto: bfloat16, or float32 on CPUs without AVX-512)",
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local diffusers Wan checkpoint instead of the built-in small config",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="time every class again, even those recorded (they are replaced in the file)",
    )
    parser.add_argument(
        "--clear",
        action="store_true",
        help="remove this machine's cache file (and files its older ditops/torch wrote), "
        "time nothing",
    )


def clear() -> int:
    """``ditops tune --clear``: forget every choice, remove this machine's file."""
    path, removed = tune.clear()
    if path is None:
        print("ditops tune: no cache file can be named here (see the warning); nothing removed")
        return 0
    for gone in removed:
        print(f"removed {gone}")
    if not removed:
        print(f"nothing to clear: {path} does not exist")
    return 0


def cli(args: argparse.Namespace, device: torch.device) -> int:
    """``ditops tune``: 0, or 2 with one line on stderr (no diffusers, a bad --model or
    --device)."""
    from ditops.bench.devices import device_problem
    from ditops.bench.load import header
    from ditops.bench.wan_model import ModelLoadError, default_dtype

    if args.clear:
        return clear()
    problem = device_problem(args.device)
    if problem:  # before the model is built: one line, no traceback
        print(f"ditops tune: {problem}", file=sys.stderr)
        return 2
    try:
        import diffusers  # noqa: F401 - the Wan model is a diffusers model
    except ImportError:
        print("ditops tune: needs diffusers: pip install 'ditops[bench]'", file=sys.stderr)
        return 2
    device = torch.device(args.device) if args.device else device
    dtype = default_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    precisions = config.PRECISIONS if args.precision == "both" else (args.precision,)
    print(f"ditops tune: the bench Wan ({args.size}) on {device}, {dtype}, {precisions}")
    for line in header():
        print(line)
    try:
        with tune.retiming() if args.force else contextlib.nullcontext():
            found = tune_wan(device, args.size, precisions, dtype, args.model)
    except ModelLoadError as exc:
        print(f"ditops tune: {exc}", file=sys.stderr)
        return 2
    print(f"tuned shape classes (cache {tune_report.cache_place()}):")
    for line in tune_report.describe(found):
        print(line)
    return 0

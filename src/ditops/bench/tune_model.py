"""``ditops tune``: time a model's shape classes ahead of time (:mod:`ditops.core.tune`).

Builds the ``ditops bench wan`` model (or ``--model PATH``), patches it as the bench does
(the fused norms, block-sparse self-attention at sparsity 0.75) in each precision asked
for, and runs one forward at a sparse step with ``DITOPS_TUNE=on``: every op call whose
shape class has no choice yet times its competitors then (FlexAttention's compile
included), and the choices land in the cache file. Later runs of the same shapes, in any
process on this machine, start from them.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ditops import config
from ditops.core import tune


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


def cli(args: argparse.Namespace, device: torch.device) -> int:
    """``ditops tune``: 0, or 2 with one line on stderr (no diffusers, a bad --model)."""
    from ditops.bench.load import header
    from ditops.bench.wan_model import ModelLoadError, default_dtype

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
        found = tune_wan(device, args.size, precisions, dtype, args.model)
    except ModelLoadError as exc:
        print(f"ditops tune: {exc}", file=sys.stderr)
        return 2
    print(f"tuned shape classes (cache {tune.cache_file()}):")
    for line in tune.describe(found):
        print(line)
    return 0

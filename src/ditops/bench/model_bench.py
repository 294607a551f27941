"""The runner a model bench (``ditops bench flux``, ``hunyuan_video``, ``ltx_video``,
``cogvideox``) is declared on: a :class:`ModelBench` says which diffusers model at which
sizes, how to make one forward's inputs, which modules are its attention and how to
headline its report; the runner builds the model (seed 0, random weights, no download),
times its forward under each variant in turns
(:func:`~ditops.bench.model_runs.interleaved_forwards`: one untimed call each, then
``rounds`` rounds, so a slow spell of a shared machine lands on every variant alike) with
the attention modules probed, and summarises and prints what a :class:`VariantKind` says.

A new bench is a module holding its ``BASE_CONFIG``, ``SIZES`` (each size: ``"config"``,
``"rounds"`` and one entry per name in ``shape``), a ``make_inputs`` and::

    BENCH = ModelBench(
        name="hunyuan_video",                       # the suite's name (errors, progress)
        title="a small HunyuanVideo config",        # the stderr line of ``ditops bench``
        model="HunyuanVideoTransformer3DModel",     # a diffusers class
        base_config=BASE_CONFIG,
        sizes=SIZES,
        shape=("latent", "text_tokens"),            # run()'s keywords that shape the inputs
        inputs=inputs,     # (config, device, dtype, **shape) -> (forward kwargs, result facts)
        attentions=lambda m: [b.attn for b in m.transformer_blocks],
        headline="hunyuan_video ({size}): {video_tokens} video tokens, ...",  # over the result
        kind=SPARSE,                                # or PRECISIONS
    )
    run, print_report, cli = BENCH.run, BENCH.print_report, BENCH.cli

The result of :meth:`ModelBench.run` (the ``--json`` entry) is ``config``, ``size``, the
``labels``, ``dtype``, the facts ``inputs`` returned, ``block_size`` (sparse kinds),
``rounds``, ``seconds`` and ``attention_seconds`` per variant, and the ``summary`` rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ditops.bench.model_runs import (
    ModuleTimer,
    build_seeded,
    interleaved_forwards,
    size_config,
    timing_summary,
)

Variants = list[tuple[str, dict[str, Any]]]

#: The model benches ``ditops bench`` runs (a module of :mod:`ditops.bench` each, holding
#: its ``BENCH`` and ``cli``); a new declaration joins here.
MODEL_BENCHES = ("flux", "hunyuan_video", "ltx_video", "cogvideox")


@dataclass(frozen=True)
class VariantKind:
    """What a family of benches compares: ``variants(block_size)`` (``(name, patch
    options)``; ``{}``: unpatched, else ``patch(model, precision="exact", **options)``), the
    ``probe(device, modules)`` each timed call carries, ``summarise(variants, outputs,
    times, probes)`` into rows, the table's ``columns`` and ``note`` (:func:`print_table`),
    the ``dtype(device)`` when none is asked for, and whether the result records the
    sparse ``block_size``."""

    variants: Callable[[int], Variants]
    probe: Callable[[torch.device, list[Any]], Any]
    summarise: Callable[..., list[dict[str, Any]]]
    columns: tuple[tuple[str, str, str], ...]
    note: str
    dtype: Callable[[torch.device], torch.dtype]
    block_size: bool


def _precision_summary(
    variants: Variants, outputs: dict[str, torch.Tensor], times: Any, probes: Any
) -> list[dict[str, Any]]:
    attn = {name: [p.seconds for p in ps] for name, ps in probes.items()}
    ref = outputs["unpatched"].double()
    peak = float(ref.abs().max()) or 1.0
    rows = []
    for name, _ in variants:
        diff = float((outputs[name].double() - ref).abs().max())
        rows.append(
            {
                **timing_summary(name, times, attn),
                "max_abs": diff,
                "max_rel": diff / peak,
                "bitwise_equal": bool(torch.equal(outputs[name], outputs["unpatched"])),
            }
        )
    return rows


def _width(spec: str) -> str:
    return spec[1:].split(".")[0]


def print_table(
    rows: list[dict[str, Any]], columns: tuple[tuple[str, str, str], ...], note: str, out: Any
) -> None:
    """``rows`` as a table, then ``note``: ``columns`` are ``(title, key, spec)``, ``spec``
    a format spec with its alignment and width (``"<12"``, ``">9.3f"``); a None value
    prints as ``-``, a bool as its word."""

    def cell(value: Any, spec: str) -> str:
        if value is None:
            return "-".rjust(int(_width(spec)))
        return format(str(value) if isinstance(value, bool) else value, spec)

    print(" ".join(format(title, spec[0] + _width(spec)) for title, _, spec in columns), file=out)
    for row in rows:
        print(" ".join(cell(row[key], spec) for _, key, spec in columns), file=out)
    print(note, file=out)


#: Unpatched, ``precision="exact"`` and ``precision="fast"``: the time inside the
#: attention modules, the drift (max abs, relative to the output's peak, bitwise), bf16.
PRECISIONS = VariantKind(
    variants=lambda _block_size: [
        ("unpatched", {}),
        ("exact", {"precision": "exact"}),
        ("fast", {"precision": "fast"}),
    ],
    probe=lambda device, modules: ModuleTimer(modules, device),
    summarise=_precision_summary,
    columns=(
        ("variant", "variant", "<10"),
        ("s/forward", "median_seconds", ">10.3f"),
        ("attention s", "median_attention_seconds", ">12.3f"),
        ("x unpatched", "speedup", ">12.3f"),
        ("bitwise", "bitwise_equal", ">8"),
        ("max abs", "max_abs", ">9.2e"),
        ("max rel", "max_rel", ">9.2e"),
    ),
    note="(medians over rounds; x unpatched: median of the per-round ratios)",
    dtype=lambda _device: torch.bfloat16,
    block_size=False,
)


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}


@dataclass(frozen=True)
class ModelBench:
    """One model bench, declared (see the module's docstring). ``kind``: what it compares
    (:data:`PRECISIONS`, or :data:`ditops.bench.sparse_video.SPARSE`); ``variants``, if
    given, replaces the kind's (``block_size -> [(name, options)]``); ``layouts``, if
    given: named changes of the config (a model's releases), one of which :meth:`run`
    takes (the first by default), :meth:`cli` running each in turn."""

    name: str
    title: str
    model: str
    base_config: dict[str, Any]
    sizes: dict[str, dict[str, Any]]
    shape: tuple[str, ...]
    inputs: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    attentions: Callable[[Any], list[Any]]
    headline: str
    kind: VariantKind
    variants: Callable[[int], Variants] | None = None
    layouts: dict[str, dict[str, Any]] | None = None

    def build(self, device: torch.device, dtype: torch.dtype, config: dict[str, Any]) -> Any:
        """The model from ``config`` (seed 0, random weights, no download), in eval mode."""
        import diffusers

        return build_seeded(getattr(diffusers, self.model), device, dtype, config)

    def run(
        self,
        device: torch.device,
        size: str = "small",
        layout: str | None = None,
        *,
        rounds: int | None = None,
        dtype: torch.dtype | None = None,
        block_size: int = 128,
        progress: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Time every variant, interleaved; returns the config, per-round times and a
        summary. ``rounds`` and the keywords named in ``shape`` replace the size's (None:
        the size's); ``dtype`` None: the kind's default for ``device``; ``block_size``: of
        the sparse attention; ``layout``: one of ``layouts`` (the result says which);
        every other keyword replaces an entry of the model config."""
        from ditops.integrations import patch, unpatch

        kind, layouts = self.kind, self.layouts or {}
        layout = next(iter(layouts)) if layout is None and layouts else layout
        if layout is not None and layout not in layouts:
            raise ValueError(f"{self.name} bench: layout must be one of {sorted(layouts)}")
        labels = {} if layout is None else {"layout": layout}
        kwargs = {**layouts.get(layout, {}), **kwargs}
        shape = {k: kwargs.pop(k, None) for k in self.shape}
        spec, config = size_config(self.name, self.sizes, size, self.base_config, kwargs)
        rounds = spec["rounds"] if rounds is None else rounds
        shape = {k: spec[k] if v is None else v for k, v in shape.items()}
        dtype = kind.dtype(device) if dtype is None else dtype
        model = self.build(device, dtype, config)
        x, facts = self.inputs(config, device, dtype, **shape)
        variants = (self.variants or kind.variants)(block_size)

        def use(options: dict[str, Any]) -> None:
            unpatch(model)
            if options:
                patch(model, **{"precision": "exact", **options})

        outputs, times, probes = interleaved_forwards(
            model,
            x,
            device,
            variants,
            use,
            rounds,
            lambda m: kind.probe(device, self.attentions(m)),
            desc=" ".join([self.name, *labels.values()]),
            progress=progress,
            reset=lambda: unpatch(model),
        )
        result = {"config": _jsonable(config), "size": size, **labels}
        result.update(dtype=str(dtype).replace("torch.", ""), **facts)
        if kind.block_size:
            result["block_size"] = block_size
        return {
            **result,
            "rounds": rounds,
            "seconds": times,
            "attention_seconds": {n: [p.seconds for p in ps] for n, ps in probes.items()},
            "summary": kind.summarise(variants, outputs, times, probes),
        }

    def print_report(self, result: dict[str, Any], out: Any = None) -> None:
        """The headline (``headline`` over ``result``) and the kind's table."""
        out = sys.stdout if out is None else out
        print("\n== " + self.headline.format(**result), file=out)
        print_table(result["summary"], self.kind.columns, self.kind.note, out)

    def announce(self, device: torch.device, size: str) -> None:
        """The stderr line of ``ditops bench`` saying what runs."""
        print(f"ditops bench: {self.name} ({self.title}) on {device}, size {size}", file=sys.stderr)

    def cli(
        self,
        device: torch.device,
        size: str,
        progress: bool,
        dtype: torch.dtype | None = None,
    ) -> dict[str, Any]:
        """``ditops bench <name>``: run and print (stderr: what runs; stdout: the report);
        with ``layouts``, each in turn (the results by layout)."""
        self.announce(device, size)
        results = {}
        for layout in self.layouts or [None]:
            results[layout] = self.run(device, size, layout, progress=progress, dtype=dtype)
            self.print_report(results[layout])
        return results if self.layouts else results[None]

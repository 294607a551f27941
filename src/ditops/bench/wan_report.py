"""The ``wan`` suite's summary, printed report and plot, from the rows :func:`ditops.bench.wan.run`
returns (see :mod:`ditops.bench.wan` for what they hold)."""

from __future__ import annotations

import sys
from typing import Any

from ditops.bench.wan_probes import SECTIONS

#: The issue's target: this sparsity at this speedup per sparse step (CPU, "small").
TARGET = (0.75, 1.8)
#: Calls timed per step in results that do not record it (written before ``repeats`` was).
UNRECORDED_REPEATS = 2


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def summary(rows: list[dict[str, Any]], n_steps: int) -> list[dict[str, Any]]:
    """Per variant: speedups over all steps and over the sparse steps alone (after an
    untimed warm-up call), where the sparse steps' time goes (estimate, attention, the
    dense attention they replace), realised densities, the worst drift, and the mean
    time per section."""
    out = []
    base = {r["step"]: r["seconds"] for r in rows if r["variant"] == "unpatched"}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        sparse_steps = [r for r in mine if not r["dense"]]
        att = [r["attention"] for r in sparse_steps]
        densities = [d for a in att for d in a["densities"]]
        requested = mine[0]["requested_density"]
        estimate_s = _mean([a["estimate_s"] for a in att])
        attention_s = _mean([a["attention_s"] for a in att])
        dense_attention_s = _mean([r["dense_attention_s"] for r in sparse_steps])
        reuse = [r["vs_per_step"] for r in sparse_steps if r["vs_per_step"] is not None]
        out.append(
            {
                "variant": name,
                "speedup_per_forward": sum(base[r["step"]] for r in mine)
                / sum(r["seconds"] for r in mine),
                "speedup_sparse_steps": (
                    sum(base[r["step"]] for r in sparse_steps)
                    / sum(r["seconds"] for r in sparse_steps)
                    if sparse_steps
                    else None
                ),
                "requested_density": requested,
                "realised_density": _mean(densities),
                "density_error": (
                    max(abs(d - requested) for d in densities) if densities else None
                ),
                "estimated_steps": sum(1 for r in sparse_steps if r["kind"] == "estimate"),
                "sparse_steps": len(sparse_steps),
                "estimate_s": estimate_s,
                "attention_s": attention_s,
                "dense_attention_s": dense_attention_s,
                "attention_speedup": _ratio(dense_attention_s, attention_s),
                "attention_with_estimate_speedup": _ratio(
                    dense_attention_s,
                    None if attention_s is None else attention_s + (estimate_s or 0.0),
                ),
                "estimate_share_of_dense_attention": _ratio(estimate_s, dense_attention_s),
                "max_abs": max(r["max_abs"] for r in mine),
                "min_cosine": min(r["cosine"] for r in mine),
                "min_psnr": min(r["psnr"] for r in mine),
                "bitwise_equal": all(r["max_abs"] == 0 for r in mine),
                "vs_per_step": (
                    {
                        "max_abs": max(x[0] for x in reuse),
                        "min_cosine": min(x[1] for x in reuse),
                        "min_psnr": min(x[2] for x in reuse),
                    }
                    if reuse
                    else None
                ),
                "mean_sections": {
                    label: sum(r["sections"][label] for r in mine) / len(mine)
                    for label in SECTIONS.values()
                },
                "mean_seconds": sum(r["seconds"] for r in mine) / len(mine),
                "sparse_step_seconds": _mean([r["seconds"] for r in sparse_steps]),
                "sparse_step_sections": (
                    {
                        label: sum(r["sections"][label] for r in sparse_steps) / len(sparse_steps)
                        for label in SECTIONS.values()
                    }
                    if sparse_steps
                    else None
                ),
            }
        )
    return out


def _f(value: Any, spec: str) -> str:
    """``value`` formatted, or a dash for a missing one (right-aligned to the width)."""
    width = spec.split(".")[0].lstrip("<>") or "0"
    if value is None:
        return "-".rjust(int(width))
    return format(value, spec)


def print_report(result: dict[str, Any], out: Any = sys.stdout) -> None:
    machine = result.get("machine", {})
    print(
        f"\n== wan: {result['video_tokens']} video tokens ({result.get('size_name', '')}), "
        f"latent {result['latent_shape']}, {result['config']['num_layers']} layers, "
        f"{result.get('dtype', 'bfloat16')}, {result['steps']} steps "
        f"({result['skip_first_steps']} dense first), faster of "
        f"{result.get('repeats', UNRECORDED_REPEATS)} calls per step",
        file=out,
    )
    if machine:
        print(
            f"machine: {machine.get('processor') or machine.get('machine')}, "
            f"{machine.get('threads')} threads, {machine.get('cpu_features', '')}, "
            f"torch {machine.get('torch')}, device {machine.get('device')}",
            file=out,
        )
    print(
        f"{'variant':<16} {'step':>4} {'kind':<8} {'s/forward':>9} {'speedup':>7} "
        f"{'est s':>6} {'attn s':>7} {'density':>7} {'max abs':>9} {'cosine':>9} {'PSNR dB':>7}",
        file=out,
    )
    for r in result["rows"]:
        a = r["attention"]
        kind = "(=norms)" if r["kind"].startswith("dense (") else r["kind"]
        print(
            f"{r['variant']:<16} {r['step']:>4} {kind:<8} {r['seconds']:>9.2f} "
            f"{r['speedup']:>7.2f} {a['estimate_s']:>6.2f} {a['attention_s']:>7.2f} "
            f"{_f(a['density'], '7.3f')} {r['max_abs']:>9.2e} {r['cosine']:>9.6f} "
            f"{r['psnr']:>7.1f}",
            file=out,
        )
    method = result.get("mask_method")
    how = f", mask method {method['method']!r}, samples {method['samples']}" if method else ""
    print(
        f"\nsparse steps, per forward ({result['config']['num_layers']} self-attentions{how}): "
        "density asked/run, estimate and attention time, speedups of the attention alone "
        "(without / with the estimate) and of the whole step, against the unpatched model",
        file=out,
    )
    print(
        f"{'variant':<16} {'asked':>5} {'run':>6} {'|err|':>6} {'est/st':>6} {'est s':>6} "
        f"{'attn s':>7} {'dense s':>7} {'est %':>6} {'attn x':>6} {'+est x':>6} "
        f"{'step x':>6} {'all x':>6} {'min cos':>9} {'minPSNR':>7}",
        file=out,
    )
    for s in result["summary"]:
        est_steps = f"{s['estimated_steps']}/{s['sparse_steps']}" if s["sparse_steps"] else None
        share = s["estimate_share_of_dense_attention"]
        cells = [
            (s["requested_density"], "5.2f"),
            (s["realised_density"], "6.3f"),
            (s["density_error"], "6.3f"),
            (est_steps, ">6"),
            (s["estimate_s"], "6.2f"),
            (s["attention_s"], "7.2f"),
            (s["dense_attention_s"], "7.2f"),
            (None if share is None else 100 * share, "6.1f"),
            (s["attention_speedup"], "6.2f"),
            (s["attention_with_estimate_speedup"], "6.2f"),
            (s["speedup_sparse_steps"], "6.2f"),
            (s["speedup_per_forward"], "6.2f"),
            (s["min_cosine"], "9.6f"),
            (s["min_psnr"], "7.1f"),
        ]
        print(f"{s['variant']:<16} " + " ".join(_f(v, spec) for v, spec in cells), file=out)
    for s in result["summary"]:
        if s["vs_per_step"] is not None:
            v = s["vs_per_step"]
            print(
                f"{s['variant']}: against estimating at every step (same sparsity, same "
                f"inputs): max abs {v['max_abs']:.2e}, min cosine {v['min_cosine']:.6f}, "
                f"min PSNR {v['min_psnr']:.1f} dB",
                file=out,
            )
    target = result.get("target") or {}
    sparsity = target.get("sparsity", TARGET[0])
    want = target.get("speedup_per_sparse_step", TARGET[1])
    for s in result["summary"]:
        requested = s["requested_density"]
        if requested is not None and abs(1 - requested - sparsity) < 1e-9:
            got = s["speedup_sparse_steps"]
            met = got is not None and got >= want
            print(
                f"target: sparsity {sparsity} at >= {want}x per sparse step against the "
                f"unpatched model ({s['variant']}): {_f(got, '.2f')}x, "
                f"{'met' if met else 'not met'}",
                file=out,
            )
            break
    print(
        "\nwhere the time goes (mean seconds per forward; sparse variants: sparse steps):", file=out
    )
    for s in result["summary"]:
        sections = s["sparse_step_sections"] or s["mean_sections"]
        total = s["sparse_step_seconds"] or s["mean_seconds"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sections.items())
        rest = total - sum(sections.values())
        inner = ""
        if s["attention_s"] is not None:
            inner = (
                f" (self-attention: estimate {s['estimate_s']:.2f}, attention "
                f"{s['attention_s']:.2f})"
            )
        print(f"  {s['variant']:<16} {parts}, rest {rest:.2f}{inner}", file=out)
    warm = ", ".join(f"{k} {v:.1f} s" for k, v in result["warmup_seconds"].items())
    print(f"untimed warm-up calls (compiles included): {warm}", file=out)
    print(
        "asked/run: block density asked for (1 - sparsity) and realised (mean over layers and "
        "sparse steps); |err|: the largest difference at any call. est/st: sparse steps "
        "that estimated masks. dense s: the unpatched model's attention time at those steps; "
        "est %: the estimate as a share of it. attn x / +est x: the attention alone, without "
        "and with the estimate; step x: the whole forward on the sparse steps; all x: over "
        "every step. Drift (cos, PSNR) against the unpatched model at equal inputs.",
        file=out,
    )


def plot(
    rows: list[dict[str, Any]], summary: list[dict[str, Any]], path: str, skip_first_steps: int
) -> None:
    """Left: time per step and variant (the first ``skip_first_steps`` shaded as dense).
    Right: where a sparse step's time goes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "ditops bench: matplotlib is not installed; no plot (pip install 'ditops[bench]')",
            file=sys.stderr,
        )
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax.plot([r["step"] for r in mine], [r["seconds"] for r in mine], marker="o", label=name)
    ax.axvspan(-0.5, skip_first_steps - 0.5, color="0.9", label="dense steps")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("seconds per forward")
    ax.set_title("Time per step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    names = [s["variant"] for s in summary]
    bottom = [0.0] * len(names)
    parts: dict[str, list[float]] = {}
    for s in summary:
        sections = s["sparse_step_sections"] or s["mean_sections"]
        total = s["sparse_step_seconds"] or s["mean_seconds"]
        est = s["estimate_s"] or 0.0
        attn = s["attention_s"] if s["attention_s"] is not None else None
        if attn is None:  # dense variants: their SDPA time, from the rows
            mine = [r["attention"]["attention_s"] for r in rows if r["variant"] == s["variant"]]
            attn = sum(mine) / len(mine)
        values = {
            "self-attention: estimate": est,
            "self-attention: attention kernel": attn,
            "self-attention: projections, rope": sections["self-attention"] - est - attn,
            "cross-attention": sections["cross-attention"],
            "feed-forward": sections["feed-forward"],
            "norms, modulation, rest": total - sum(sections.values()),
        }
        for label, value in values.items():
            parts.setdefault(label, []).append(max(value, 0.0))
    for label, values in parts.items():
        bx.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bx.set_ylabel("seconds per forward (sparse steps)")
    bx.set_title("Where the time goes")
    bx.tick_params(axis="x", labelrotation=20, labelsize=8)
    bx.legend(fontsize=7)
    fig.suptitle("Wan forward, unpatched vs ditops (ditops bench)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

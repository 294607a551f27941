"""The headline figures of the README and the docs' home page, read from the recorded
runs in ``benchmarks/`` (a maintainer's tool, not public API; written by
``python -m ditops.docs_tables``, checked by ``tests/test_docs.py``).

Each :data:`HEADLINES` entry names a JSON file a bench command wrote; its row takes the
machine and the command from that file, so a figure on a page is never older than its
file, and re-recording a file changes the page at the next regeneration. The plot is an
SVG written here from the same numbers (text, so the test compares it byte for byte).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Headline:
    """One row: ``file`` under ``benchmarks/``, what ran, and how to read its results."""

    file: str
    model: str
    #: data -> (exact cell, sparse cell, exact speedup, sparse speedup)
    read: Callable[[dict[str, Any]], tuple[str, str, float, float]]
    #: the command, when the file does not record it
    command: str = ""


def _by_variant(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in rows}


def _bitwise(row: dict[str, Any]) -> str:
    return "bitwise" if row.get("bitwise_equal") else "NOT bitwise"


def _cells(
    exact: dict[str, Any], sparse: dict[str, Any], key: str, per: str, psnr: str
) -> tuple[str, str, float, float]:
    """The exact and sparse cells of a row, from two variants' summaries."""
    ex, sp = exact[key], sparse[per]
    return (
        f"{ex:.2f}x per forward, {_bitwise(exact)}",
        f"{sp:.2f}x per {'sparse step' if per == 'speedup_sparse_steps' else 'forward'} "
        f"(attention {sparse['attention_speedup']:.2f}x), PSNR {sparse[psnr]:.0f} dB",
        ex,
        sp,
    )


def _wan(data: dict[str, Any]) -> tuple[str, str, float, float]:
    rows = _by_variant(data["wan"]["summary"])
    return _cells(
        rows["norms exact"], rows["sparse 0.75"], "speedup_per_forward",
        "speedup_sparse_steps", "min_psnr",
    )  # fmt: skip


def _video(key: str, layout: str | None = None) -> Callable[..., tuple[str, str, float, float]]:
    def read(data: dict[str, Any]) -> tuple[str, str, float, float]:
        run = data[key] if layout is None else data[key][layout]
        rows = _by_variant(run["summary"])
        return _cells(rows["exact"], rows["sparse 0.75"], "speedup", "speedup", "psnr_db")

    return read


def _h200(data: dict[str, Any]) -> tuple[str, str, float, float]:
    speed = max(data["attention"]["speed"], key=lambda s: s["S"])
    return (
        "",
        f"{speed['speedup_keep0.25']:.2f}x dense SDPA at keep 0.25, {speed['S']} tokens",
        math.nan,
        speed["speedup_keep0.25"],
    )


#: The rows, newest machines' runs of each model's bench first.
HEADLINES = (
    Headline("cpu/wan-flex.json", "Wan (2 layers of Wan2.1-1.3B, 8064 tokens, bf16)", _wan),
    Headline("cpu/wan-avx2.json", "Wan (the same, fp32)", _wan),
    Headline(
        "cpu/hunyuan_video-bfloat16-flex.json",
        "HunyuanVideo geometry (4992 video tokens, bf16)",
        _video("hunyuan_video"),
    ),
    Headline(
        "cpu/ltx_video-bfloat16.json", "LTX-Video (3072 video tokens, bf16)", _video("ltx_video")
    ),
    Headline(
        "cpu/cogvideox-float32.json",
        "CogVideoX 1.0 (4992 video tokens, fp32)",
        _video("cogvideox", "1.0"),
    ),
    Headline(
        "gpu/results/h200-check.json",
        "block-sparse attention op",
        _h200,
        command="python benchmarks/gpu/check_gpu.py OUT_DIR",
    ),
)


def _machine(data: dict[str, Any]) -> str:
    if "gpu" in data:
        return f"{data['gpu']}, torch {data['torch']}"
    m = data["machine"]
    feats = re.sub(r"^torch CPU capability \w+, ", "", m.get("cpu_features") or "")
    feats = feats.replace("AVX-512 with bf16", "AVX-512 + BF16")
    return f"CPU, {m.get('threads', '?')} threads, {feats}"


def _command(data: dict[str, Any], given: str) -> str:
    if given:
        return given
    cmd = data.get("command", "")
    # the recording's own paths (a worktree's src/ditops/__main__.py, a venv's bin/) -> ditops
    return re.sub(r"^\S*(?:ditops/__main__\.py|bin/ditops|ditops/cli\.py)\b", "ditops", cmd)


def rows(root: Path = ROOT) -> list[tuple[Headline, dict[str, Any], tuple[str, str, float, float]]]:
    out = []
    for h in HEADLINES:
        data = json.loads((root / "benchmarks" / h.file).read_text())
        out.append((h, data, h.read(data)))
    return out


def table(root: Path = ROOT, link: str = "benchmarks/README.md") -> str:
    """The results table (markdown), each row with its machine and command."""
    lines = [
        "| model | exact precision | sparsity 0.75 | machine | command |",
        "|---|---|---|---|---|",
    ]
    for h, data, (exact, sparse, _, _) in rows(root):
        command = f"`{_command(data, h.command)}`"
        lines.append(f"| {h.model} | {exact or '-'} | {sparse} | {_machine(data)} | {command} |")
    note = (
        f"\nRatios against the unpatched model measured in one run (files and load: "
        f"[the recorded runs]({link})); every file under `benchmarks/` with its command."
    )
    return "\n".join(lines) + "\n" + note + "\n"


def svg(root: Path = ROOT) -> str:
    """A horizontal bar chart of the same rows: exact and sparse 0.75 speedups."""
    data = [(h.model, ex, sp) for h, _, (_, _, ex, sp) in rows(root)]
    top = max(v for _, ex, sp in data for v in (ex, sp) if not math.isnan(v))
    scale = 280 / math.ceil(top)
    left, bar, gap = 300, 12, 10
    height = 40 + len(data) * (2 * bar + gap) + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 720 {height}" '
        f'font-family="sans-serif" font-size="12">',
        '<text x="0" y="14" font-weight="bold">Speedup over the unpatched model '
        "(1 = as fast)</text>",
    ]
    y = 30
    for model, ex, sp in data:
        out.append(f'<text x="0" y="{y + bar + 4}">{model}</text>')
        for value, colour, label in ((ex, "#6c8ebf", "exact"), (sp, "#d6763a", "sparse 0.75")):
            if not math.isnan(value):
                w = value * scale
                out.append(
                    f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colour}"/>'
                )
                out.append(f'<text x="{left + w + 4:.1f}" y="{y + 10}">{value:.2f}x {label}</text>')
            y += bar
        y += gap
    one = left + scale
    out.append(f'<line x1="{one:.1f}" y1="24" x2="{one:.1f}" y2="{y}" stroke="#444" '
               'stroke-dasharray="3,3"/>')  # fmt: skip
    out.append(f'<text x="{one - 4:.1f}" y="{y + 14}">1x</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

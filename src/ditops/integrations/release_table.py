"""Which family each diffusers release is served deep on, read from the fingerprint table
(:data:`~ditops.integrations.shared.fingerprint_table.KNOWN`): the docs' release table and
``ditops info``'s line. A family is served on a release when every function it relies on
that the release has is accepted there (its fingerprint listed for that release with an
arithmetic ditops runs); it is absent when the release lacks its main block."""

from __future__ import annotations

from typing import Any

from ditops.integrations.patching import FAMILIES
from ditops.integrations.shared.family import DeclaredFamily
from ditops.integrations.shared.fingerprint_table import KNOWN, MAIN, MAIN_VERSION, RELEASES


def _labels_of(table: object) -> list[str]:
    """The labels whose table ``table`` is (or merges: FLUX.2's two processors)."""
    same = [label for label, known in KNOWN.items() if known is table]
    return same or [label for label, known in KNOWN.items() if (
        isinstance(table, dict) and known and set(known) <= set(table))]  # fmt: skip


def labels(family: DeclaredFamily) -> list[str]:
    """Every label of the table ``family`` checks, its main block's first, its attention
    processors' last."""
    spec = family.spec
    tables = [k.known for b in spec.blocks for k in b.kinds]
    tables += [fn_table[1] for fn_table in spec.relied_on().values()]
    if spec.attention is not None and spec.attention.relied is not None:
        for ours in spec.attention.processors.values():
            try:  # reads the wrapped processor's module, which older releases may lack
                relied = spec.attention.relied(ours)
            except (ImportError, AttributeError):  # ChronoEdit, SkyReels' helper in 0.35
                continue
            tables += [fn_table[1] for fn_table in relied.values()]
    out = dict.fromkeys(label for table in tables for label in _labels_of(table))
    return list(out) + [p for p in _processors(family) if p not in out]


def _processors(family: DeclaredFamily) -> list[str]:
    attention = family.spec.attention
    return [] if attention is None else _labels_of(attention.known)


def _present(label: str, release: str) -> bool:
    return any(release in s.releases for s in KNOWN[label].values())


def status(family: DeclaredFamily, release: str) -> tuple[str, list[str]]:
    """``("deep" | "absent" | "refused", notes)``: the variants matched other than the
    newest's, or the functions refused. Absent: the release lacks the family's main block
    or every processor it wraps."""
    try:  # the labels come from the installed diffusers' modules
        names = labels(family)
    except ImportError:  # the family's module is not in the installed release
        return "absent", []
    except AttributeError as e:  # a function it relies on is not there: not its arithmetic
        return "refused", [str(e)]
    processors = _processors(family)
    if not _present(names[0], release) or (
        processors and not any(_present(p, release) for p in processors)
    ):
        return "absent", []
    refused, variants = [], []
    for label in names:
        for seen in KNOWN[label].values():
            if release not in seen.releases:
                continue
            if seen.arithmetic is None:
                refused.append(f"{label} ({seen.note})")
            elif seen.arithmetic != "0.42":
                variants.append(f"{label}: {seen.arithmetic}'s arithmetic")
    return ("refused", refused) if refused else ("deep", variants)


def families() -> list[DeclaredFamily]:
    return [f for f in FAMILIES if isinstance(f, DeclaredFamily)]


def served_on(version: str) -> list[str] | None:
    """The families served deep on diffusers ``version`` per the table, or None when the
    table does not cover that version."""
    release = MAIN if version == MAIN_VERSION else version
    if release not in (*RELEASES, MAIN):
        return None
    return [f.name for f in families() if status(f, release)[0] == "deep"]


def release_table() -> str:
    """The docs' table: one row per release (and the main snapshot), one column per family;
    ``yes`` served deep, ``yes*`` with an older release's arithmetic, ``no`` refused
    (footnotes say which function), ``-`` absent from the release."""
    fams = families()
    lines = [
        "| diffusers | " + " | ".join(f.name for f in fams) + " |",
        "|---|" + "---|" * len(fams),
    ]
    notes: list[str] = []
    for release in (*RELEASES, MAIN):
        cells = []
        for family in fams:
            what, why = status(family, release)
            mark = {"deep": "yes*" if why else "yes", "refused": "no", "absent": "-"}[what]
            cells.append(mark)
            if why:
                notes.append(f"- {release}, {family.name}: {'; '.join(why)}")
        lines.append(f"| {release} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(dict.fromkeys(notes)) + "\n"


def diffusers_report() -> dict[str, Any]:
    """The installed diffusers and the families served deep on it (``ditops info``)."""
    try:
        import diffusers
    except ImportError:
        return {"version": None, "deep": [], "line": "diffusers: not installed"}
    version = diffusers.__version__
    deep = served_on(version)
    if deep is None:
        line = (
            f"diffusers {version}: a release the fingerprint table does not cover; each "
            "family is checked function by function when patched"
        )
    else:
        line = f"diffusers {version}: served deep: {', '.join(deep) or 'none'}"
    return {"version": version, "deep": deep, "line": line}

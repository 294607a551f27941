"""The fingerprints ditops knows (see :mod:`~ditops.integrations.shared.fingerprints` for
what a fingerprint is): label -> fingerprint -> :class:`Seen`, where it was seen and whose
arithmetic ditops reproduces for it (``None``: a different arithmetic, refused with the
reason). Made from ``release_survey`` run on every release from the floor
(:data:`RELEASES`) and on the stored snapshot of diffusers' main branch (:data:`MAIN`);
``tests/integrations/test_release_fingerprints.py`` checks it against the installed
release, and ``.ci/releases`` against the floor, a middle release and the newest.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The diffusers releases checked, oldest first: every release on the index from the
#: floor in ``pyproject.toml`` to the newest.
RELEASES: tuple[str, ...] = (
    "0.35.0", "0.35.1", "0.35.2", "0.36.0", "0.37.0", "0.37.1",
    "0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1",
)  # fmt: skip
#: The stored snapshot of diffusers' main branch (older than the newest release).
MAIN = "main@58eb52c0"
#: What ``diffusers.__version__`` says in that snapshot.
MAIN_VERSION = "0.40.0.dev0"


@dataclass(frozen=True)
class Seen:
    """Where one fingerprint of a function was seen, and whose arithmetic it is."""

    #: The releases (and :data:`MAIN`) whose function has this fingerprint.
    releases: tuple[str, ...]
    #: The release whose arithmetic ditops reproduces for it (the variant its family
    #: selects), or None: its arithmetic differs from every variant ditops has (refused).
    arithmetic: str | None
    #: Why it is refused, or what differs from the newest release, in a few words.
    note: str = ""

    def __str__(self) -> str:
        return f"diffusers {span(self.releases)}"


def releases_between(first: str, last: str) -> tuple[str, ...]:
    """The releases from ``first`` to ``last``, both included."""
    return RELEASES[RELEASES.index(first) : RELEASES.index(last) + 1]


def span(releases: tuple[str, ...]) -> str:
    """``("0.35.0", ..., "0.37.1", MAIN)`` -> ``"0.35.0-0.37.1, main@58eb52c0"``."""
    runs: list[list[str]] = []
    for r in (r for r in RELEASES if r in releases):
        if runs and RELEASES.index(runs[-1][-1]) == RELEASES.index(r) - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ", ".join(parts + [MAIN] * (MAIN in releases))


_r = releases_between
#: 0.39 and before split heads by count (``attn.heads``), later releases by ``head_dim``.
_HEADS_BY_COUNT = "heads split by count, not head_dim: the same split untensor-parallel"

# fmt: off
KNOWN: dict[str, dict[str, Seen]] = {
    "AdaLayerNorm.forward": {
        "ba61e3547e899624": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "AdaLayerNormContinuous.forward": {
        "97fe56b38b46032e": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "AdaLayerNormZero.forward": {
        "238d505f32c743e7": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "AdaLayerNormZeroSingle.forward": {
        "96f17e4770e15bc2": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ChromaAdaLayerNormContinuousPruned.forward": {
        "f95c9319ddf53e13": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ChromaAdaLayerNormZeroPruned.forward": {
        "c81f361abb60d7d5": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ChromaAdaLayerNormZeroSinglePruned.forward": {
        "f86132bd9d074ea2": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ChromaSingleTransformerBlock.forward": {
        "445401c84bcccc58": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ChromaTransformerBlock.forward": {
        "6b2f15f8b3021de5": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "CogVideoXAttnProcessor2_0.__call__": {
        "c645f0b1d17f3dd3": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "CogVideoXBlock.forward": {
        "29401a1b49a4f734": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "CogVideoXLayerNormZero.forward": {
        "f77f376e83167e9c": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "CogVideoXPatchEmbed.forward": {
        "ca9bc82ca0de5ada": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "FinalLayer.forward": {
        "88c026ff824ebbdd": Seen(_r("0.36.0", "0.36.0"), "0.42",
            "no per-token (noisy/clean) modulation: the same global one"),
        "ba75a38896591147": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "Flux2AttnProcessor.__call__": {
        "e6dba65f0e6fa7cd": Seen(_r("0.36.0", "0.39.0"), "0.42",
            _HEADS_BY_COUNT),
        "0740aa4a222d83c2": Seen(_r("0.40.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "Flux2ParallelSelfAttnProcessor.__call__": {
        "edc8cd199972a85b": Seen(_r("0.36.0", "0.39.0"), "0.42",
            _HEADS_BY_COUNT),
        "ea6d4afcbd27187a": Seen(_r("0.40.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "Flux2SingleTransformerBlock.forward": {
        "7a4cb40ec4b2d562": Seen(_r("0.36.0", "0.36.0"), "0.42",
            "modulation passed split (tuples), not split in the block: the same chunks"),
        "4d80d4a09445b850": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "Flux2TransformerBlock.forward": {
        "310b2b1103b11b4e": Seen(_r("0.36.0", "0.36.0"), "0.42",
            "modulation passed split (tuples), not split in the block: the same chunks"),
        "a35f2a4b302cd526": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "FluxAttnProcessor.__call__": {
        "38011775fd662cb8": Seen(_r("0.35.0", "0.35.2"), "0.36",
            "no context parallelism; to_out on the split views"),
        "d86cc30d4e5d31e0": Seen(_r("0.36.0", "0.36.0"), "0.36",
            "to_out on the split views, not contiguous copies"),
        "1011958677784f65": Seen(_r("0.37.0", "0.39.0"), "0.42",
            _HEADS_BY_COUNT),
        "20faad9ce73da78f": Seen(_r("0.40.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "FluxSingleTransformerBlock.forward": {
        "b9592e8858fb297a": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "FluxTransformerBlock.forward": {
        "c1c5a901c432cf87": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideo15AttnProcessor2_0.__call__": {
        "9ff3ded5169bea4c": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoAttnProcessor2_0.__call__": {
        "1d91bcbfb9c240fc": Seen(_r("0.35.0", "0.35.2"), "0.42",
            "SDPA called on [B, H, S, D] directly: the same attention"),
        "09d6f2527eec783f": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoSingleTransformerBlock.forward": {
        "6e41198e96e23390": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoTokenReplaceAdaLayerNormZero.forward": {
        "acfa3b6abd049f2e": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle.forward": {
        "72e0c494e38041f4": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoTokenReplaceSingleTransformerBlock.forward": {
        "a8d8a63630a7f2a7": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoTokenReplaceTransformerBlock.forward": {
        "b9f1be13fbad286c": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "HunyuanVideoTransformerBlock.forward": {
        "0d6e3449921b7a47": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "JointAttnProcessor2_0.__call__": {
        "0beadcda5b19829b": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "JointTransformerBlock.forward": {
        "37fa3a905c22d710": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTX2Attention.forward": {
        "84452895ed48c826": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTX2AudioVideoAttnProcessor.__call__": {
        "847fb6847e02e1ed": Seen(_r("0.37.0", "0.37.1"), None,
            "before the audio-video attention of 0.38"),
        "bda9ff13e2414c0d": Seen(_r("0.38.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTX2VideoTransformerBlock.forward": {
        "d7bb1a16fbf25240": Seen(_r("0.37.0", "0.37.1"), None,
            "before prompt adaLN and KV-cacheable cross-attention"),
        "c865936b51ecb2ba": Seen(_r("0.38.0", "0.39.0"), "0.42",
            "no static prompt table: a path their model never takes"),
        "478c7be6edc9a87b": Seen(_r("0.40.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTX2VideoTransformerBlock.get_mod_params": {
        "9c7885883f3ed724": Seen(_r("0.38.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTXAttention.forward": {
        "9059db8119a3b1cc": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTXVideoAttnProcessor.__call__": {
        "0c8b5201b6a21ce3": Seen(_r("0.35.0", "0.35.2"), "0.42",
            "no context parallelism in 0.35: dispatch without parallel_config"),
        "09e975bcb8e3867f": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "LTXVideoTransformerBlock.forward": {
        "d511f7c9e6bdf5c8": Seen(_r("0.35.0", "0.35.1"), "0.42",
            "scale_shift_table not moved to temb's device: same on one device"),
        "2c641b9b3d6dda86": Seen(_r("0.35.2", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiAttnProcessor2_0.__call__": {
        "655d6ecba9b11b71": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiLayerNormContinuous.forward": {
        "f78921341ec9aaba": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiModulatedRMSNorm.forward": {
        "63a41276f253d034": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiRMSNorm.forward": {
        "3fff98e6e2fd85dc": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiRMSNormZero.forward": {
        "1c6ac8946c44bf53": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "MochiTransformerBlock.forward": {
        "353f59492792a3fb": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "QwenDoubleStreamAttnProcessor2_0.__call__": {
        "4b945b18ed36654b": Seen(_r("0.35.0", "0.35.2"), "0.36",
            "no context parallelism; text mask unused; to_out on the split views"),
        "ae92e49854e506dd": Seen(_r("0.36.0", "0.36.0"), "0.36",
            "text mask unused (attention_mask as given); to_out on the split views"),
        "e9cfc2f8c1889e63": Seen(_r("0.37.0", "0.38.0"), "0.38",
            "the joint mask comes as attention_mask, built by the model"),
        "42d13a508cb5b267": Seen(_r("0.39.0", "0.39.0"), "0.42",
            _HEADS_BY_COUNT),
        "8f3ad066164b778b": Seen(_r("0.40.0", "0.41.0") + (MAIN,), "0.42",
            "rotary per device: Neuron's real-angle path is never fused"),
        "dccfcb67a396179e": Seen(_r("0.42.0", "0.42.1"), "0.42"),
    },
    "QwenImageTransformerBlock._modulate": {
        "4b56fa6be47175d7": Seen(_r("0.35.0", "0.36.0"), "0.42",
            "no per-token index (zero_cond_t): the same without one"),
        "c3335a4657aaf912": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "QwenImageTransformerBlock.forward": {
        "c8a8ce8b18410de3": Seen(_r("0.35.0", "0.36.0"), "0.42",
            "no zero_cond_t: the same without it"),
        "0f27194aff1229e4": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "RMSNorm.forward": {
        "b96d586600445900": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
        "c722c6969a3ef086": Seen(_r("0.41.0", "0.42.1"), "0.42", "torch_npu: NPU branch kept"),
    },
    "SD35AdaLayerNormZeroX.forward": {
        "fcd91df4fd44dcd3": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "SkyReelsV2TransformerBlock.forward": {
        "a8b4e4e948b5cc3a": Seen(_r("0.35.0", "0.35.2"), "0.42",
            "attention called by keyword: the same call"),
        "2752c9f6bdaf2edb": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "WanAttnProcessor.__call__": {
        "a6792da55d366c35": Seen(_r("0.35.0", "0.35.2"), "0.42",
            "no context parallelism in 0.35: dispatch without parallel_config"),
        "0ed7f62085c8a482": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
        "fdddaece8af34468": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "WanTransformerBlock.forward": {
        "36ca5bffefbb01ae": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "WanVACETransformerBlock.forward": {
        "9b54a2503fd5e4b5": Seen(_r("0.35.0", "0.35.1"), "0.42",
            "scale_shift_table not moved to temb's device: same on one device"),
        "5fe6b78622d11d61": Seen(_r("0.35.2", "0.42.1") + (MAIN,), "0.42"),
    },
    "ZImageTransformerBlock.forward": {
        "8a36be5fdca5db80": Seen(_r("0.36.0", "0.36.0"), "0.42",
            "no per-token (noisy/clean) modulation: the same global one"),
        "48c974cc2ee59378": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "ZSingleStreamAttnProcessor.__call__": {
        "4875207078b3f0ca": Seen(_r("0.36.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "_chunked_feed_forward": {
        "8bcb47c82820d464": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "_get_qkv_projections": {
        "6e502d47e4614be4": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
        "4ca933ec60f81b43": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "apply_rotary_emb": {
        "4d3aaa8d868f9ee2": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "apply_rotary_emb_qwen": {
        "3b737db5ed907d6e": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "select_per_token": {
        "ccbcff82bddd6f42": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "transformer_ltx.apply_rotary_emb": {
        "39352abc1377c2b6": Seen(_r("0.35.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "transformer_ltx2.apply_interleaved_rotary_emb": {
        "39352abc1377c2b6": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
    "transformer_ltx2.apply_split_rotary_emb": {
        "7c3354b2cdc1a322": Seen(_r("0.37.0", "0.42.1") + (MAIN,), "0.42"),
    },
}
# fmt: on

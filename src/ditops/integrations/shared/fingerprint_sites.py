"""Where each function a family relies on lives in diffusers: label -> ``(module, qualname)``
of every copy checked under that label (a processor copied into another model's module is
checked under the original's label). The release survey (``python -m
ditops.integrations.shared.release_survey``) and the release tests read it; patching finds the
functions on the model itself."""

from __future__ import annotations

_N = "diffusers.models.normalization"
_E = "diffusers.models.embeddings"
_T = "diffusers.models.transformers."

#: label -> where its copies live.
SITES: dict[str, tuple[tuple[str, str], ...]] = {
    "RMSNorm.forward": ((_N, "RMSNorm.forward"),),
    "AdaLayerNormZero.forward": ((_N, "AdaLayerNormZero.forward"),),
    "AdaLayerNormZeroSingle.forward": ((_N, "AdaLayerNormZeroSingle.forward"),),
    "AdaLayerNormContinuous.forward": ((_N, "AdaLayerNormContinuous.forward"),),
    "AdaLayerNorm.forward": ((_N, "AdaLayerNorm.forward"),),
    "CogVideoXLayerNormZero.forward": ((_N, "CogVideoXLayerNormZero.forward"),),
    "SD35AdaLayerNormZeroX.forward": ((_N, "SD35AdaLayerNormZeroX.forward"),),
    "MochiRMSNorm.forward": ((_N, "MochiRMSNorm.forward"),),
    "apply_rotary_emb": ((_E, "apply_rotary_emb"),),
    "CogVideoXPatchEmbed.forward": ((_E, "CogVideoXPatchEmbed.forward"),),
    "_chunked_feed_forward": (("diffusers.models.attention", "_chunked_feed_forward"),),
    "CogVideoXAttnProcessor2_0.__call__": (
        ("diffusers.models.attention_processor", "CogVideoXAttnProcessor2_0.__call__"),
    ),
    "JointAttnProcessor2_0.__call__": (
        ("diffusers.models.attention_processor", "JointAttnProcessor2_0.__call__"),
    ),
    "MochiAttnProcessor2_0.__call__": (
        ("diffusers.models.attention_processor", "MochiAttnProcessor2_0.__call__"),
    ),
    "CogVideoXBlock.forward": ((_T + "cogvideox_transformer_3d", "CogVideoXBlock.forward"),),
    "WanTransformerBlock.forward": (
        (_T + "transformer_wan", "WanTransformerBlock.forward"),
        (_T + "transformer_chronoedit", "WanTransformerBlock.forward"),
        (_T + "transformer_wan_animate", "WanTransformerBlock.forward"),
    ),
    "WanAttnProcessor.__call__": (
        (_T + "transformer_wan", "WanAttnProcessor.__call__"),
        (_T + "transformer_chronoedit", "WanAttnProcessor.__call__"),
        (_T + "transformer_wan_animate", "WanAttnProcessor.__call__"),
        (_T + "transformer_skyreels_v2", "SkyReelsV2AttnProcessor.__call__"),
    ),
    "_get_qkv_projections": (
        (_T + "transformer_wan", "_get_qkv_projections"),
        (_T + "transformer_chronoedit", "_get_qkv_projections"),
        (_T + "transformer_wan_animate", "_get_qkv_projections"),
        (_T + "transformer_skyreels_v2", "_get_qkv_projections"),
    ),
    "WanVACETransformerBlock.forward": (
        (_T + "transformer_wan_vace", "WanVACETransformerBlock.forward"),
    ),
    "SkyReelsV2TransformerBlock.forward": (
        (_T + "transformer_skyreels_v2", "SkyReelsV2TransformerBlock.forward"),
    ),
    "FluxTransformerBlock.forward": ((_T + "transformer_flux", "FluxTransformerBlock.forward"),),
    "FluxSingleTransformerBlock.forward": (
        (_T + "transformer_flux", "FluxSingleTransformerBlock.forward"),
    ),
    "FluxAttnProcessor.__call__": ((_T + "transformer_flux", "FluxAttnProcessor.__call__"),),
    "Flux2TransformerBlock.forward": ((_T + "transformer_flux2", "Flux2TransformerBlock.forward"),),
    "Flux2SingleTransformerBlock.forward": (
        (_T + "transformer_flux2", "Flux2SingleTransformerBlock.forward"),
    ),
    "Flux2AttnProcessor.__call__": ((_T + "transformer_flux2", "Flux2AttnProcessor.__call__"),),
    "Flux2ParallelSelfAttnProcessor.__call__": (
        (_T + "transformer_flux2", "Flux2ParallelSelfAttnProcessor.__call__"),
    ),
    "HunyuanVideoTransformerBlock.forward": (
        (_T + "transformer_hunyuan_video", "HunyuanVideoTransformerBlock.forward"),
        (_T + "transformer_hunyuan_video15", "HunyuanVideo15TransformerBlock.forward"),
    ),
    "HunyuanVideoSingleTransformerBlock.forward": (
        (_T + "transformer_hunyuan_video", "HunyuanVideoSingleTransformerBlock.forward"),
    ),
    "HunyuanVideoTokenReplaceTransformerBlock.forward": (
        (_T + "transformer_hunyuan_video", "HunyuanVideoTokenReplaceTransformerBlock.forward"),
    ),
    "HunyuanVideoTokenReplaceSingleTransformerBlock.forward": (
        (
            _T + "transformer_hunyuan_video",
            "HunyuanVideoTokenReplaceSingleTransformerBlock.forward",
        ),
    ),
    "HunyuanVideoTokenReplaceAdaLayerNormZero.forward": (
        (_T + "transformer_hunyuan_video", "HunyuanVideoTokenReplaceAdaLayerNormZero.forward"),
    ),
    "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle.forward": (
        (
            _T + "transformer_hunyuan_video",
            "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle.forward",
        ),
    ),
    "HunyuanVideoAttnProcessor2_0.__call__": (
        (_T + "transformer_hunyuan_video", "HunyuanVideoAttnProcessor2_0.__call__"),
    ),
    "HunyuanVideo15AttnProcessor2_0.__call__": (
        (_T + "transformer_hunyuan_video15", "HunyuanVideo15AttnProcessor2_0.__call__"),
    ),
    "LTXVideoTransformerBlock.forward": (
        (_T + "transformer_ltx", "LTXVideoTransformerBlock.forward"),
    ),
    "transformer_ltx.apply_rotary_emb": ((_T + "transformer_ltx", "apply_rotary_emb"),),
    "LTXAttention.forward": ((_T + "transformer_ltx", "LTXAttention.forward"),),
    "LTXVideoAttnProcessor.__call__": ((_T + "transformer_ltx", "LTXVideoAttnProcessor.__call__"),),
    "LTX2VideoTransformerBlock.forward": (
        (_T + "transformer_ltx2", "LTX2VideoTransformerBlock.forward"),
    ),
    "LTX2VideoTransformerBlock.get_mod_params": (
        (_T + "transformer_ltx2", "LTX2VideoTransformerBlock.get_mod_params"),
    ),
    "transformer_ltx2.apply_interleaved_rotary_emb": (
        (_T + "transformer_ltx2", "apply_interleaved_rotary_emb"),
    ),
    "transformer_ltx2.apply_split_rotary_emb": (
        (_T + "transformer_ltx2", "apply_split_rotary_emb"),
    ),
    "LTX2Attention.forward": ((_T + "transformer_ltx2", "LTX2Attention.forward"),),
    "LTX2AudioVideoAttnProcessor.__call__": (
        (_T + "transformer_ltx2", "LTX2AudioVideoAttnProcessor.__call__"),
    ),
    "JointTransformerBlock.forward": (
        ("diffusers.models.attention", "JointTransformerBlock.forward"),
    ),
    "ChromaTransformerBlock.forward": (
        (_T + "transformer_chroma", "ChromaTransformerBlock.forward"),
    ),
    "ChromaSingleTransformerBlock.forward": (
        (_T + "transformer_chroma", "ChromaSingleTransformerBlock.forward"),
    ),
    "ChromaAdaLayerNormZeroPruned.forward": (
        (_T + "transformer_chroma", "ChromaAdaLayerNormZeroPruned.forward"),
    ),
    "ChromaAdaLayerNormZeroSinglePruned.forward": (
        (_T + "transformer_chroma", "ChromaAdaLayerNormZeroSinglePruned.forward"),
    ),
    "ChromaAdaLayerNormContinuousPruned.forward": (
        (_T + "transformer_chroma", "ChromaAdaLayerNormContinuousPruned.forward"),
    ),
    "MochiTransformerBlock.forward": ((_T + "transformer_mochi", "MochiTransformerBlock.forward"),),
    "MochiRMSNormZero.forward": ((_T + "transformer_mochi", "MochiRMSNormZero.forward"),),
    "MochiModulatedRMSNorm.forward": ((_T + "transformer_mochi", "MochiModulatedRMSNorm.forward"),),
    "MochiLayerNormContinuous.forward": (
        (_T + "transformer_mochi", "MochiLayerNormContinuous.forward"),
    ),
    "QwenImageTransformerBlock.forward": (
        (_T + "transformer_qwenimage", "QwenImageTransformerBlock.forward"),
    ),
    "QwenImageTransformerBlock._modulate": (
        (_T + "transformer_qwenimage", "QwenImageTransformerBlock._modulate"),
    ),
    "apply_rotary_emb_qwen": ((_T + "transformer_qwenimage", "apply_rotary_emb_qwen"),),
    "QwenDoubleStreamAttnProcessor2_0.__call__": (
        (_T + "transformer_qwenimage", "QwenDoubleStreamAttnProcessor2_0.__call__"),
    ),
    "ZImageTransformerBlock.forward": (
        (_T + "transformer_z_image", "ZImageTransformerBlock.forward"),
    ),
    "FinalLayer.forward": ((_T + "transformer_z_image", "FinalLayer.forward"),),
    "select_per_token": ((_T + "transformer_z_image", "select_per_token"),),
    "ZSingleStreamAttnProcessor.__call__": (
        (_T + "transformer_z_image", "ZSingleStreamAttnProcessor.__call__"),
    ),
}

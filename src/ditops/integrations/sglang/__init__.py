"""ditops inside sglang's diffusion runtime (``sglang.multimodal_gen``), as a general
plugin: no sglang file is edited, and no platform slot is taken.

Switch: ``DITOPS_SGLANG=1`` (read by :func:`ditops.config.sglang_enabled`). Without it the
entry point below registers nothing and sglang runs exactly as stock. With it, in every
sglang process, whatever platform sglang picked (CPU, CUDA, ROCm, NPU, a vendor's
out-of-tree platform):

* :mod:`.plugin`: hooks registered with sglang's ``HookRegistry`` (entry-point group
  ``sglang.multimodal_gen.plugins``, name ``ditops``) that bind ditops' forwards to the
  op classes it serves, resolve ``block_sparse_attn`` to ditops' backend, check
  ``--attention-backend-config`` when sglang builds its arguments, and stop sglang's
  loader from swapping in diffusers' class when ditops' code failed a model build;
* :mod:`.forwards`: the served classes; :mod:`.norms` (``FP32LayerNorm``, ``RMSNorm``,
  ``LayerNormScaleShift``, ``ScaleResidualLayerNormScaleShift``) and :mod:`.elementwise`
  (``MulAdd``, ``RMSNormNoWeight``, ``RMSNormScaleShift``,
  ``ScaleResidualRMSNormScaleShift``, ``GeluAndMul``, ``NewGELU``) and :mod:`.rotary`
  (``RotaryEmbedding``) in sglang's arithmetic;
* :mod:`.attention`: the ``block_sparse_attn`` backend, driven by
  ``--attention-backend-config``.

Tested with sglang 0.5.21 (torch 2.13.0, CI: ``.ci/sglang``) and 0.5.23 (torch 2.14.1,
run once; docs/sglang.md). What the adapter relies on in sglang, to check on a new release:

* ``sglang.multimodal_gen.runtime.platforms.plugins``: the entry-point group, that
  plugins run in every process before models are built, ``HookRegistry``/``HookType``;
* the hook targets in :mod:`.plugin` (``CustomOp.dispatch_forward``,
  ``selector._cached_get_attn_backend``, ``ServerArgs.__post_init__`` having parsed
  ``attention_backend_config`` and chosen ``pipeline_config`` (its ``is_causal``),
  ``ComponentLoader._load_native_with_context``);
* the served classes' arguments and ``forward_native`` arithmetic, and
  ``fuse_scale_shift_kernel_native`` (``sglang.kernels.ops.diffusion.common.fallback_torch``);
* ``AttentionBackend``/``AttentionImpl`` (q/k/v ``[B, S, H, D]``), ``DenoisingStage``'s
  ``build(current_timestep, skip_first_steps, sparsity, raw_latent_shape, patch_size)``
  for ``BLOCK_SPARSE_ATTN``, ``get_forward_context().forward_batch.is_cfg_negative``.
"""

from __future__ import annotations

#: The entry point's name (``SGLANG_PLUGINS`` lists plugins by it).
PLUGIN_NAME = "ditops"


def activate() -> None:
    """sglang's plugin entry point: registers ditops' hooks when ``DITOPS_SGLANG=1``;
    with the switch off it does nothing (and imports nothing of sglang)."""
    from ditops.config import sglang_enabled

    if not sglang_enabled():
        return None
    from ditops.integrations.sglang.plugin import register_hooks

    register_hooks()
    return None


__all__ = ["PLUGIN_NAME", "activate"]

"""ditops inside sglang's diffusion runtime (``sglang.multimodal_gen``), through its own
plug-in points: no sglang file is edited or patched.

Switch: ``DITOPS_SGLANG=1`` (read by :func:`ditops.config.sglang_enabled`). Without it the
entry point below answers ``None`` and sglang runs exactly as stock. With it, in every
sglang process:

* :mod:`.platform`: an out-of-tree platform (entry-point group
  ``sglang.multimodal_gen.platforms``, name ``ditops``) that is the built-in platform of
  the host (CPU, CUDA or Ascend NPU; others are refused) with three changes: its
  ``init_backend()`` registers ditops' forwards for sglang's norm modules, its dispatch
  key is the host's kind (so every op ditops does not serve keeps its built-in
  ``forward_<kind>``), and ``block_sparse_attn`` resolves to ditops' backend;
* :mod:`.norms`: those forwards (``FP32LayerNorm``, ``RMSNorm``, ``LayerNormScaleShift``,
  ``ScaleResidualLayerNormScaleShift``) in sglang's arithmetic;
* :mod:`.attention`: the ``block_sparse_attn`` backend, driven by
  ``--attention-backend-config``.

Tested with sglang 0.5.21 (torch 2.13.0); ``tests/sglang`` runs in its own environment
(``.ci/sglang``). What the adapter relies on in sglang, to check on a new release:

* ``sglang.multimodal_gen.runtime.platforms``: the entry-point group, ``PlatformEnum.OOT``,
  ``builtin_platform_plugins`` (the host's detectors), the built-in classes ``CpuPlatform``,
  ``CudaPlatform``, ``NPUPlatformBase``, ``Platform.init_backend`` and
  ``apply_server_args_defaults``;
* ``CustomOp.register_oot_forward`` and ``get_dispatch_key_name`` (ops bind in
  ``__init__``);
* the four norm classes' arguments and ``forward_native`` arithmetic, and
  ``fuse_scale_shift_kernel_native`` (``sglang.kernels.ops.diffusion.common.fallback_torch``);
* ``AttentionBackend``/``AttentionImpl`` (q/k/v ``[B, S, H, D]``), ``DenoisingStage``'s
  ``build(current_timestep, skip_first_steps, sparsity, raw_latent_shape, patch_size)``
  for ``BLOCK_SPARSE_ATTN``, ``get_forward_context().forward_batch.is_cfg_negative``.
"""

from __future__ import annotations

import os

#: The entry point's name, and the value of SGLANG_DIFFUSION_PLATFORM_OVERRIDE that picks it.
PLUGIN_NAME = "ditops"


def activate() -> str | None:
    """sglang's platform entry point: the qualified name of ditops' platform class for this
    host when ``DITOPS_SGLANG=1``, else ``None`` (sglang picks its built-in platform).

    Raises RuntimeError on a host whose built-in platform ditops does not serve, and when
    sglang is told to pick ``ditops`` by name while the switch is off.
    """
    from ditops.config import sglang_enabled

    if not sglang_enabled():
        if os.environ.get("SGLANG_DIFFUSION_PLATFORM_OVERRIDE", "").strip() == PLUGIN_NAME:
            raise RuntimeError(
                "SGLANG_DIFFUSION_PLATFORM_OVERRIDE=ditops selects ditops' platform, which is "
                "off: set DITOPS_SGLANG=1 to use it, or unset the override"
            )
        return None
    from ditops.integrations.sglang.platform import platform_qualname

    return platform_qualname()


__all__ = ["PLUGIN_NAME", "activate"]

"""ditops' block-sparse attention as sglang's ``block_sparse_attn`` backend.

``--attention-backend block_sparse_attn`` selects it (ditops' plugin resolves that name
to :class:`DitopsBlockSparseBackend` on every platform); ``--attention-backend-config``
drives it:

* sglang's keys: ``sparsity`` (share of blocks skipped, ``[0, 1)``; sglang's default 0.2)
  and ``skip_first_steps`` (denoising steps run dense; sglang's default 10). sglang's
  ``DenoisingStage`` reads them and calls our builder's ``build(current_timestep,
  skip_first_steps, sparsity, raw_latent_shape, patch_size)`` once per step;
* ditops' keys (:class:`ditops.attention.BlockSparseConfig`): ``estimate_every``,
  ``method``, ``samples``, ``block_size``, ``stride``, ``threshold``, ``forced_blocks``.

Any other key, or a value ditops refuses, stops sglang at start-up (when it builds its
arguments, and again when a worker builds the model) with a message listing what is
supported; on an NPU ``block_size`` must be one the NPU kernels take (128 to 512, a
multiple of 128).

Each attention layer (one impl per layer) holds a
:class:`ditops.layers.sparse_attention.BlockSparseAttention`: dense SDPA before
``skip_first_steps``, then ditops' estimate and block-sparse attention at the density
``1 - sparsity`` over each head's whole block map, the first latent frame, sink and
recent blocks included (ditops' honest density, not sglang's NPU reading of it); masks
reused per layer and per guidance branch (sglang's ``is_cfg_negative``) for
``estimate_every`` steps. The ops dispatch per call: ditops' CPU paths, its Triton path
on CUDA, sgl-kernel-npu's kernels on an Ascend NPU, exactly as ditops calls them
elsewhere. A call the layer cannot make sparse (cross-attention reaching it, a step
without this backend's metadata) runs dense SDPA, sglang's own arithmetic, with one
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum

from ditops.attention import BlockSparseConfig
from ditops.attention.schedule import first_frame_dense_blocks
from ditops.layers.sparse_attention import BlockSparseAttention

log = logging.getLogger(__name__)

#: The config keys sglang itself reads for this backend (with its defaults).
SGLANG_KEYS = {"sparsity": 0.2, "skip_first_steps": 10}
#: ditops' own keys, passed to BlockSparseConfig.
DITOPS_KEYS = (
    "estimate_every",
    "method",
    "samples",
    "block_size",
    "stride",
    "threshold",
    "forced_blocks",
)
#: Block sizes sgl-kernel-npu's kernels take.
NPU_BLOCK_SIZES = (128, 256, 384, 512)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def config_from(options: Mapping[str, Any] | None, kind: str = "cpu") -> BlockSparseConfig:
    """The :class:`BlockSparseConfig` that ``--attention-backend-config`` asks for (with
    sglang's defaults for its own keys); ValueError naming what is supported otherwise."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(SGLANG_KEYS) - set(DITOPS_KEYS))
    if unknown:
        raise ValueError(
            f"block_sparse_attn (ditops): unknown --attention-backend-config key(s) "
            f"{', '.join(unknown)}; supported: {', '.join([*SGLANG_KEYS, *DITOPS_KEYS])}"
        )
    values = {**SGLANG_KEYS, **options}
    try:
        cfg = BlockSparseConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"block_sparse_attn (ditops): {error}") from error
    if kind == "npu" and cfg.block_size not in NPU_BLOCK_SIZES:
        raise ValueError(
            f"block_sparse_attn (ditops): block_size={cfg.block_size} on an NPU; "
            f"sgl-kernel-npu's kernels take {NPU_BLOCK_SIZES}"
        )
    return cfg


def _server_config() -> Mapping[str, Any]:
    from sglang.multimodal_gen.runtime.server_args import get_global_server_args

    return get_global_server_args().attention_backend_config or {}


def device_type() -> str:
    """The device type of sglang's current platform (``cpu`` when it names none)."""
    from sglang.multimodal_gen.runtime.platforms import current_platform

    return str(getattr(current_platform, "device_type", "") or "cpu")


def _device_kind() -> str:
    return device_type()


@dataclass
class DitopsBlockSparseMetadata(AttentionMetadata):
    """One denoising step's settings: the step index (``current_timestep``), the config
    and the first latent frame's blocks (kept dense)."""

    skip_first_steps: int
    sparsity: float
    config: BlockSparseConfig
    dense_blocks: int


class DitopsBlockSparseMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`DitopsBlockSparseMetadata` for each step (sglang's call)."""

    def __init__(self) -> None:
        pass

    def prepare(self) -> None:
        pass

    def build(  # type: ignore[override]
        self,
        current_timestep: int,
        skip_first_steps: int,
        sparsity: float,
        raw_latent_shape: Any,
        patch_size: Any,
        **kwargs: Any,
    ) -> DitopsBlockSparseMetadata:
        options = {**_server_config(), "sparsity": sparsity, "skip_first_steps": skip_first_steps}
        cfg = config_from(options, _device_kind())
        dense = first_frame_dense_blocks(list(raw_latent_shape), patch_size, cfg.block_size)
        return DitopsBlockSparseMetadata(
            current_timestep=int(current_timestep),
            skip_first_steps=cfg.skip_first_steps,
            sparsity=cfg.sparsity,
            config=cfg,
            dense_blocks=dense,
        )


class DitopsBlockSparseImpl(AttentionImpl):
    """One attention layer: q, k, v in sglang's ``[B, S, H, D]``."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        causal: bool,
        softmax_scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        **extra_impl_args: Any,
    ) -> None:
        config_from(_server_config(), _device_kind())  # refuse at model build, not mid-run
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.prefix = prefix
        self.layer: BlockSparseAttention | None = None

    def _dense(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, why: str):
        _warn_once(why, f"ditops block_sparse_attn: {why}; dense SDPA runs there")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        return out.transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        if not isinstance(attn_metadata, DitopsBlockSparseMetadata):
            return self._dense(query, key, value, "a call without block_sparse_attn's metadata")
        if query.shape[1] != key.shape[1]:
            return self._dense(query, key, value, f"{self.prefix}: cross-attention")
        cfg = replace(attn_metadata.config, causal=self.causal)
        if self.layer is None or self.layer.config != cfg:
            self.layer = BlockSparseAttention(cfg)  # a new config drops the kept masks
        return self.layer(
            query,
            key,
            value,
            layout="BSND",
            scale=self.softmax_scale,
            step=attn_metadata.current_timestep,
            branch=_branch(),
            dense_blocks=attn_metadata.dense_blocks,
        )


def _branch() -> str:
    """The guidance branch of this forward (sglang marks the unconditional one)."""
    from sglang.multimodal_gen.runtime.managers.forward_context import get_forward_context

    batch = get_forward_context().forward_batch
    return "uncond" if getattr(batch, "is_cfg_negative", False) else "cond"


class DitopsBlockSparseBackend(AttentionBackend):
    """sglang's ``block_sparse_attn`` (``AttentionBackendEnum`` is closed: it reports
    ``BLOCK_SPARSE_ATTN``, so sglang builds per-step metadata with our builder)."""

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return []  # any

    @staticmethod
    def get_enum() -> AttentionBackendEnum:
        return AttentionBackendEnum.BLOCK_SPARSE_ATTN

    @staticmethod
    def get_impl_cls() -> type[DitopsBlockSparseImpl]:
        return DitopsBlockSparseImpl

    @staticmethod
    def get_metadata_cls() -> type[DitopsBlockSparseMetadata]:
        return DitopsBlockSparseMetadata

    @staticmethod
    def get_builder_cls() -> type[DitopsBlockSparseMetadataBuilder]:
        return DitopsBlockSparseMetadataBuilder


__all__ = [
    "DITOPS_KEYS",
    "SGLANG_KEYS",
    "DitopsBlockSparseBackend",
    "DitopsBlockSparseImpl",
    "DitopsBlockSparseMetadata",
    "DitopsBlockSparseMetadataBuilder",
    "config_from",
]

"""The base of the attention processors ditops installs over diffusers' own: one
constructor for all of them, built as ditops builds them (``cls(original, ops=...,
steps=..., sparse=...)``) or as diffusers' loaders do (``type(p)()``: a new processor of
the class it wraps, with no ops: that processor's own code runs)."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from ditops.integrations.shared.fingerprints import arithmetic_of


def _on_original(name: str) -> property:
    """An attribute read from and written to the wrapped ``original`` (None while unset)."""

    def get(self: WrappingProcessor) -> Any:
        return getattr(self.original, name, None)

    def set(self: WrappingProcessor, value: Any) -> None:
        setattr(self.original, name, value)

    return property(get, set)


class WrappingProcessor:
    """Base of the attention processors ditops installs over diffusers' own (``original``).

    diffusers writes the attention backend (``set_attention_backend``) and the
    context-parallel config (``enable_parallelism`` writes ``_parallel_config`` into every
    processor that has the attribute) on processors. Here both live on the original, read
    and written through, so they reach the code that runs the attention before and after
    the patch and survive ``unpatch``. A processor keeping its own would, under context
    parallelism, attend within each rank's shard: silently wrong.
    """

    #: The diffusers processor a subclass wraps: (module, class name).
    wraps: tuple[str, str] = ("", "")
    #: Whether it serves block-sparse attention (else being handed a sparse layer is refused).
    serves_sparse: ClassVar[bool] = True
    #: The relied-on label of the wrapped ``__call__`` when a subclass reproduces more than
    #: one release's arithmetic (None: one arithmetic for every release served).
    arithmetic_label: ClassVar[str | None] = None

    def __init__(
        self,
        original: Any | None = None,
        ops: Any = None,
        steps: Any = None,
        sparse: Any = None,
    ) -> None:
        if sparse is not None and not self.serves_sparse:
            raise ValueError(f"{type(self).__name__}: this family has no sparse attention")
        if sparse is not None and steps is None:
            raise ValueError(f"{type(self).__name__}: sparse attention needs the step state")
        if original is None:  # built as diffusers' loaders build processors: type(p)()
            original = self.original_processor()
        self.original = original
        self.ops = ops  # the patched model's op bundle (None: the original's own code)
        self.steps = steps  # the step state sparse attention follows
        self.sparse = sparse  # the block-sparse attention layer (None: dense)
        # The release whose arithmetic the original's __call__ matched, decided here once:
        # a fingerprint reads source code, which has no place in a forward or a traced graph.
        label = self.arithmetic_label
        self.arithmetic = None if label is None else arithmetic_of(type(original).__call__, label)

    @classmethod
    def original_processor(cls) -> Any:
        """A new processor of the diffusers class this one wraps: what ``type(p)()`` (as
        diffusers' loaders build processors) wraps."""
        module, name = cls.wraps
        return getattr(importlib.import_module(module), name)()

    _parallel_config = _on_original("_parallel_config")
    _attention_backend = _on_original("_attention_backend")

    def _dispatch_dense(self, query: Any, key: Any, value: Any, attention_mask: Any = None) -> Any:
        """Dense attention as diffusers' Wan and HunyuanVideo processors call it:
        ``dispatch_attention_fn`` with the wrapped processor's backend and context-parallel
        config (diffusers' own exchange, if any)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            **self._parallel_kwargs(),
        )

    def _parallel_kwargs(self) -> dict[str, Any]:
        """``parallel_config=`` for ``dispatch_attention_fn`` when there is one: diffusers
        0.35 has no context parallelism and its ``dispatch_attention_fn`` no such argument
        (with None, later releases compute the same)."""
        config = self._parallel_config
        return {} if config is None else {"parallel_config": config}


class DenseProcessor(WrappingProcessor):
    """Base of ditops' processors that fuse the prologue of diffusers' dense attention
    (FLUX's, SD3's): no sparse attention."""

    serves_sparse = False


def register_like(ours: type, theirs: type) -> None:
    """Tell diffusers' ``AttentionProcessorRegistry`` (what LayerSkip and other hooks look
    processors up in) that ``ours`` behaves as ``theirs`` (the processor it wraps) does,
    where diffusers registers ``theirs``; where it does not, both are refused alike."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
    except ImportError:  # an older diffusers without the registry: nothing looks there
        return
    try:
        metadata = AttentionProcessorRegistry.get(theirs)
    except ValueError:
        return
    AttentionProcessorRegistry.register(ours, metadata)

"""Minimal repro: compiled FlexAttention on CPU with *full* blocks (torch 2.13: works).

An earlier field note said torch 2.13's CPU FlexAttention failed to compile when given
``full_kv_num_blocks``/``full_kv_indices`` (a C++ error, ``kv_indices`` not declared).
This compiles full blocks alone (no ``mask_mod``) and full plus partial blocks with a
causal ``mask_mod``, in fp32 and bf16, and checks the result against SDPA with the
same token mask. The test suite watches the same thing through the ``cuda`` path tests
in tests/ops/test_block_sparse_attention.py (FlexAttention on CPU tensors, full blocks since
``to_flex_block_mask`` uses them).

    PYTHONPATH=src python benchmarks/cpu/probes/flex_full_blocks.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    i32 = {"dtype": torch.int32}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 1, 256, 16, generator=gen).to(dtype) for _ in range(3))
        for causal in (False, True):
            # Query block 0: key block 1 full. Query block 1: key block 0 full, and (causal)
            # block 1 partial with q >= kv.
            partial = [0, 1] if causal else [0, 0]
            bm = BlockMask.from_kv_blocks(
                torch.tensor([[partial]], **i32),
                torch.tensor([[[[0, 0], [1, 0]]]], **i32),
                torch.tensor([[[1, 1]]], **i32),
                torch.tensor([[[[1, 0], [0, 0]]]], **i32),
                BLOCK_SIZE=128,
                mask_mod=(lambda b, h, qi, ki: qi >= ki) if causal else None,
                seq_lengths=(256, 256),
                compute_q_blocks=False,
            )
            allowed = torch.zeros(256, 256, dtype=torch.bool)
            allowed[:128, 128:] = True
            allowed[128:, :128] = True
            if causal:
                allowed[128:, 128:] = torch.ones(128, 128, dtype=torch.bool).tril()
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  attn_mask=allowed)  # fmt: skip
            try:
                with torch.no_grad():
                    out = compiled(q, k, v, block_mask=bm)
            except Exception as exc:  # noqa: BLE001 - the point is to report it
                print(f"{dtype} causal={causal}: FAILS to compile: {type(exc).__name__}: {exc}")
                continue
            err = float((out.float() - want).abs().max())
            print(f"{dtype} causal={causal}: compiles, max |out - SDPA| = {err:.1e}")


if __name__ == "__main__":
    main()

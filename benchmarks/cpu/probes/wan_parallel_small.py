"""``ditops bench --parallel MODE`` on a smaller video, for a 2-core CPU.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/cpu/probes/wan_parallel_small.py \
        ulysses --json benchmarks/cpu/wan_parallel_ulysses.json

Each rank runs the one-process model and its share of the parallel one, one thread each,
so the default video (8064 tokens, 4 steps, two timings per step) takes hours on 2 cores.
This runs the same bench on 21 latent frames of 8 x 12 tokens (2016), 3 steps (1 dense),
one timing per step, in float32 (the --dtype auto choice on CPUs without AVX-512).
"""

from __future__ import annotations

import sys

from ditops import cli
from ditops.bench import wan

wan.LATENTS["small"] = (1, 16, 21, 16, 24)
wan.STEPS["small"] = 3
wan.REPEATS = 1

if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    sys.exit(cli.main(["bench", "--parallel", mode, "--no-progress", *rest]))

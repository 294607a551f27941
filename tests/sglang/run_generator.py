"""One ``DiffGenerator`` run of a checkpoint, frames saved as .npy: run as a script (sglang
spawns its scheduler and workers, which re-import the main module).

``python run_generator.py CHECKPOINT OUT.npy [BACKEND [CONFIG]]`` (ports from
``RUN_GENERATOR_PORT_BASE`` when set); the video is 9 frames of 128 x 128 (an image with
``RUN_GENERATOR_KIND=image``) in 2 steps (``RUN_GENERATOR_STEPS``) with guidance, seed 0.
Prints the seconds the generator took to start, to generate, and per step.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    import numpy as np
    from sglang.multimodal_gen import DiffGenerator

    checkpoint, out = sys.argv[1], sys.argv[2]
    kwargs: dict[str, object] = {}
    base = int(os.environ.get("RUN_GENERATOR_PORT_BASE", "0"))
    if base:  # runs side by side need ports of their own
        kwargs.update(master_port=base, scheduler_port=base + 1, port=base + 2)
    if len(sys.argv) > 3 and sys.argv[3]:
        kwargs["attention_backend"] = sys.argv[3]
        if len(sys.argv) > 4:
            kwargs["attention_backend_config"] = sys.argv[4]
    image = os.environ.get("RUN_GENERATOR_KIND") == "image"
    steps = int(os.environ.get("RUN_GENERATOR_STEPS", "2"))
    start = time.perf_counter()
    generator = DiffGenerator.from_pretrained(model_path=checkpoint, num_gpus=1, **kwargs)
    built = time.perf_counter()
    try:
        params = dict(
            prompt="a red cat runs in the snow", height=128, width=128, num_frames=9,
            num_inference_steps=steps, guidance_scale=5.0, seed=0, return_frames=True,
            save_output=False,
        )  # fmt: skip
        if image:
            del params["num_frames"]
        if os.environ.get("RUN_GENERATOR_IMAGE"):  # image-to-video: the first frame
            params["image_path"] = os.environ["RUN_GENERATOR_IMAGE"]
        result = generator.generate(sampling_params_kwargs=params)
        done = time.perf_counter()
    finally:
        generator.shutdown()
    np.save(out, np.asarray(result.frames, dtype=np.float32))
    print(f"start {built - start:.1f} s, generate {done - built:.1f} s ({steps} steps)")


if __name__ == "__main__":
    main()

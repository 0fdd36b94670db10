"""Generate an image with the Python API (the same engine the server runs).

    python examples/python_api.py [CHECKPOINT_DIR] [-o out.png]

Without a checkpoint it builds the tiny demo Stable Diffusion model (random weights: the
picture is noise, the code path is the real one).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="diffusers checkpoint directory or hub id")
    parser.add_argument("-o", "--output", default="out.png")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pipelines import Pipeline
    from pipelines.demo import build_demo_model

    checkpoint = args.checkpoint or str(build_demo_model("sd", Path.home() / ".cache/mmserve/demo/sd"))
    with Pipeline.from_pretrained(checkpoint) as pipe:
        handle = pipe.submit(args.prompt, num_inference_steps=args.steps, seed=args.seed)
        for event in handle.events():
            if event.kind.value == "progress":
                print(f"step {event.data['step']}/{event.data['total']}")
        images = handle.result()["images"]
    images[0].save(args.output)
    print(f"saved {args.output} ({images[0].size[0]}x{images[0].size[1]}, seed {args.seed})")


if __name__ == "__main__":
    main()

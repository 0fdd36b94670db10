"""Talk to a running mmserve with the official OpenAI Python client.

    make serve            # in another terminal
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import base64

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused-in-demo-mode")
    parser.add_argument("--model", default="sd-demo")
    parser.add_argument("-o", "--output", default="openai_client.png")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    for model in client.models.list():
        print(model.id, getattr(model, "tasks", None))
    result = client.images.generate(model=args.model, prompt="a red bicycle", size="64x64",
                                    response_format="b64_json", extra_body={"seed": 1, "num_inference_steps": 2})
    with open(args.output, "wb") as f:
        f.write(base64.b64decode(result.data[0].b64_json))
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()

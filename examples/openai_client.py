"""Talk to a running mmserve with the official OpenAI Python client.

    make serve            # in another terminal
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import asyncio
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
    image = base64.b64decode(result.data[0].b64_json)
    with open(args.output, "wb") as f:
        f.write(image)
    print(f"saved {args.output}")
    served = {m.id for m in client.models.list()}

    # Chat with the demo language model, then about the image just made with a vision-language model.
    if "llama-demo" in served:
        reply = client.chat.completions.create(model="llama-demo", messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=8, temperature=0)
        print("chat:", reply.choices[0].finish_reason, reply.usage.completion_tokens, "tokens")
    if "qwen-vl-demo" in served:
        data_uri = "data:image/png;base64," + base64.b64encode(image).decode()
        reply = client.chat.completions.create(model="qwen-vl-demo", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": data_uri}}]}])
        print("image chat:", reply.choices[0].finish_reason, reply.usage.prompt_tokens, "prompt tokens")

    # A text-to-video job (the OpenAI-style /v1/videos job API), polled to completion.
    if "wan-demo" in served:
        import time

        import httpx

        root = args.base_url.rstrip("/")
        job = httpx.post(f"{root}/videos", json={"model": "wan-demo", "prompt": "waves", "size": "32x32",
                                                 "num_frames": 5, "num_inference_steps": 2, "seed": 0}).json()
        while job["status"] in ("queued", "in_progress", "finalizing"):  # until an end state
            time.sleep(0.2)
            job = httpx.get(f"{root}/videos/{job['id']}").json()
        video = httpx.get(f"{root}/videos/{job['id']}/content").content
        print("video job:", job["status"], len(video), "bytes of mp4")

    # Embeddings, speech and transcription when those demo models are served.
    embedder = next((m for m in ("minilm-demo", "clip-demo") if m in served), None)
    if embedder:
        vectors = client.embeddings.create(model=embedder, input=["a cat", "a kitten"])
        print("embeddings:", len(vectors.data), "x", len(vectors.data[0].embedding))
    if "vits-demo" in served:
        speech = client.audio.speech.create(model="vits-demo", voice="alloy", input="Hello there.",
                                            response_format="wav")
        audio = speech.read()
        print("speech:", len(audio), "bytes of wav")
        asr = next((m for m in ("whisper-tiny-en", "whisper-demo") if m in served), None)
        if asr:
            text = client.audio.transcriptions.create(model=asr, file=("hello.wav", audio, "audio/wav"))
            print("transcription:", repr(text.text))

    # A realtime voice session (WS /v1/realtime) through the SDK's realtime client: a typed question, a spoken answer.
    if "voice-demo" in served:
        print("voice:", asyncio.run(voice_turn(args.base_url, args.api_key)))


async def voice_turn(base_url: str, api_key: str) -> str:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key=api_key).realtime.connect(model="voice-demo") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello!"}]})
        await conn.response.create()
        audio, transcript = 0, ""
        async for event in conn:
            if event.type == "response.output_audio.delta":
                audio += len(base64.b64decode(event.delta))
            elif event.type == "response.output_audio_transcript.delta":
                transcript += event.delta
            elif event.type == "response.done":
                return f"{event.response.status}, {audio // 2 / 24000:.2f} s of 24 kHz pcm16 audio, " \
                    f"transcript {transcript!r}"
        return "the session ended early"


if __name__ == "__main__":
    main()

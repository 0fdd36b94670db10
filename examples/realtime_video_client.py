"""A camera-style client of WS /v1/realtime/video: send a few JPEG frames, get the stylised frames back.

    make serve            # in another terminal
    python examples/realtime_video_client.py [--url ws://127.0.0.1:8000/v1/realtime/video] [--model sd-demo]

Binary frames both ways: a 4-byte big-endian header length, a JSON header, then the JPEG bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time

import websockets
from PIL import Image, ImageDraw


def pack(header: dict, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + payload


def unpack(frame: bytes) -> tuple[dict, bytes]:
    size = int.from_bytes(frame[:4], "big")
    return json.loads(frame[4:4 + size]), frame[4 + size:]


def camera_frame(index: int, size: int) -> bytes:
    """A test card with the frame index painted in."""
    image = Image.new("RGB", (size, size), (40 * index % 256, 90, 160))
    ImageDraw.Draw(image).text((4, 4), str(index), fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


async def run(url: str, model: str, frames: int, size: int, fps: float) -> dict:
    async with websockets.connect(f"{url}?model={model}", max_size=16 << 20) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "mode": "img2img", "prompt": "a watercolour painting", "size": f"{size}x{size}", "steps": 2,
            "strength": 0.5, "seed": 7, "output_format": "jpeg", "frame_deadline_ms": 30_000}}))
        created = json.loads(await ws.recv())
        if created["type"] != "session.created":
            raise SystemExit(f"refused: {created}")
        for seq in range(frames):
            await ws.send(pack({"seq": seq, "frame_idx": seq, "content_type": "image/jpeg",
                                "capture_ts_ms": time.time() * 1000}, camera_frame(seq, size)))
            await asyncio.sleep(1 / fps)
        outputs, dropped = [], []
        while len(outputs) + len(dropped) < frames:
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, bytes):
                header, jpeg = unpack(message)
                outputs.append((header["seq"], Image.open(io.BytesIO(jpeg)).size))
            elif (event := json.loads(message))["type"] == "frame.dropped":
                dropped.append((event["seq"], event["reason"]))
            elif event["type"] == "error":
                raise SystemExit(f"error: {event['error']}")
        return {"session": created["session"]["id"], "outputs": outputs, "dropped": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime/video")
    parser.add_argument("--model", default="sd-demo")
    parser.add_argument("--frames", type=int, default=6)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--fps", type=float, default=10.0)
    args = parser.parse_args()
    result = asyncio.run(run(args.url, args.model, args.frames, args.size, args.fps))
    print(f"video session {result['session']}: {len(result['outputs'])} frames out "
          f"(seq {[s for s, _ in result['outputs']]}), dropped {result['dropped']}")


if __name__ == "__main__":
    main()

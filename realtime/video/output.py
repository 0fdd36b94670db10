"""Output frames -> binary messages of one session, encoded in the media workers.

jpeg / webp: one message per frame. fmp4: one message per call (a chunk, or one img2img frame),
a fragmented-MP4 segment that continues the session's timeline; the first segment, and the
first after a size change, carries the init segment (header `init: true`), so a player (e.g.
Media Source Extensions) can start or re-initialise from it. The concatenated messages of one
epoch are one valid MP4.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from realtime.video.protocol import OUTPUT_CONTENT_TYPES


@dataclass(frozen=True)
class OutputMessage:
    header: dict[str, Any]  # header fields the encoding decides (content_type, init, frames)
    payload: bytes


class OutputEncoder:
    def __init__(self, engine, fmt: str, quality: int):
        self.engine = engine
        self.fmt = fmt  # jpeg | webp | fmp4
        self.quality = quality  # jpeg / webp quality; fmp4 uses the H.264 default constant quality
        self._next_frame = 0  # fmp4 timeline: the next segment's first frame
        self._next_fragment = 1  # ... and its first fragment number
        self._init_size: tuple[int, int] | None = None  # (H, W) of the last init segment sent

    def messages_for(self, frames: int) -> int:
        """Binary messages (credits) `frames` frames become."""
        return 1 if self.fmt == "fmp4" else frames

    def restart(self) -> None:
        """A new epoch: the timeline restarts and the next segment carries the init segment again."""
        self._next_frame, self._next_fragment, self._init_size = 0, 1, None

    async def encode(self, frames: np.ndarray, fps: float) -> list[OutputMessage]:
        """uint8 [T, H, W, 3] frames -> messages, in order."""
        content_type = OUTPUT_CONTENT_TYPES[self.fmt]
        if self.fmt != "fmp4":
            jobs = [self.engine.run_media("encode_image", np.ascontiguousarray(f), self.fmt, self.quality,
                                          param="output_format") for f in frames]
            return [OutputMessage({"content_type": content_type}, data) for data in await asyncio.gather(*jobs)]
        size = tuple(frames.shape[1:3])
        with_init = size != self._init_size
        segment = await self.engine.run_media("encode_fmp4_segment", np.ascontiguousarray(frames), fps,
                                              first_frame=self._next_frame, first_fragment=self._next_fragment,
                                              with_init=with_init, param="output_format")
        self._next_frame += segment.frames
        self._next_fragment += segment.fragments
        self._init_size = size
        return [OutputMessage({"content_type": content_type, "init": with_init, "frames": segment.frames},
                              segment.data)]

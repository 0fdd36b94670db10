"""Speech recognition models (Whisper family): request checks, 30 s windows, the asr stage behind them.

Long audio is cut into windows of at most 30 s before anything runs, each cut placed at the
quietest 20 ms of the window's last `cut_search_s` seconds (so words are rarely split), and
all windows decode in parallel (their times are stitched by offset, stages/speech/asr_transcript.py).
Unlike openai-whisper's sequential "seek" loop, a window is not conditioned on the previous
window's text: that is what lets every window of every request share one forward.

English-only checkpoints (`.en`) take no language token: `language` may be omitted or English,
anything else is refused, and they cannot translate. `prompt` is applied to every window
(openai-whisper applies it to the first and conditions later windows on earlier text), keeping
its last `max_prompt_tokens` tokens as openai-whisper does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipelines.image_request import RequestError
from stages.pool import PoolConfig
from stages.speech.asr import AsrJob, AsrStage
from stages.speech.asr_transcript import AudioWindow

ASR_FAMILY = "whisper"
TRANSCRIBE, TRANSLATE = "transcribe", "translate"  # Whisper's tasks
# ModelInfo.tasks: every Whisper model does speech-to-text (/v1/audio/transcriptions); multilingual ones also
# translate speech into English text (/v1/audio/translations), English-only ones cannot.
SPEECH_TO_TEXT_TASK, TRANSLATIONS_TASK = "speech-to-text", "translations"
SAMPLE_RATE = 16000  # what Whisper's feature extractor expects; decode_audio resamples to it
# A window costs 0.5-2 s on a CPU (tiny.en, 2 cores): waiting 50 ms for company is a few percent of a lone
# request's time, and lets a burst of requests share one decode loop instead of queueing behind the first.
ASR_POOL = PoolConfig(max_batch_size=32, max_delay_ms=50.0, max_queue=256)


@dataclass(frozen=True)
class AsrConfig:
    max_windows: int = 8  # windows in one decode loop
    encoder_batch: int | None = None  # windows in one encoder forward; None: 1 on a CPU (no faster batched),
    # else max_windows
    max_new_tokens: int | None = None  # tokens per window; None: the model's limit (448 minus the prompt)
    max_prompt_tokens: int = 223  # the prompt's last N tokens are kept (openai-whisper: max_target_positions // 2 - 1)
    max_prompt_chars: int = 8000  # longer prompts are refused before tokenizing
    cut_search_s: float = 5.0  # long audio: where in each 30 s window to look for a quiet cut point

    def __post_init__(self):
        if min(self.max_windows, self.max_new_tokens or 1, self.encoder_batch or 1) < 1:
            raise ValueError("asr.max_windows, asr.max_new_tokens and asr.encoder_batch must be >= 1")
        if not 0 <= self.cut_search_s < 30 or self.max_prompt_tokens < 0 or self.max_prompt_chars < 0:
            raise ValueError("asr.cut_search_s must be in [0, 30); asr.max_prompt_tokens/chars must be >= 0")


@dataclass
class TranscriptionRequest:
    """What the caller asked for, with the audio decoded (mono float32 at 16 kHz)."""

    audio: np.ndarray  # float32 [N] at SAMPLE_RATE
    task: str = TRANSCRIBE  # or TRANSLATE (into English)
    language: str | None = None  # ISO-639-1 code ("de") or English name ("german"); None: detect / English-only
    prompt: str | None = None  # text to continue from: spellings, style
    temperature: float = 0.0  # 0: greedy; (0, 1]: sampling
    timestamps: bool = False  # segment times from the model's timestamp tokens (srt, vtt, verbose_json)
    stream: bool = False  # text deltas as the windows decode


class TranscriptionFields(Protocol):
    """What `TranscriptionModel.check` reads of a request: a TranscriptionRequest, or the route's parsed fields
    before the audio is decoded."""

    task: str
    language: str | None
    prompt: str | None
    temperature: float


def cut_windows(samples: np.ndarray, *, window_s: float = 30.0, search_s: float = 5.0,
                rate: int = SAMPLE_RATE) -> list[tuple[int, int]]:
    """[start, end) sample spans of at most `window_s`, each cut at the quietest 20 ms of its last `search_s`."""
    n, window, frame = len(samples), int(window_s * rate), rate // 50
    spans, start = [], 0
    while n - start > window:
        lo, hi = start + window - int(search_s * rate), start + window
        frames = samples[lo:hi][: (hi - lo) // frame * frame].reshape(-1, frame) if hi - lo >= frame else None
        cut = hi if frames is None else lo + int(np.argmin((frames ** 2).mean(axis=1))) * frame + frame // 2
        spans.append((start, cut))
        start = cut
    spans.append((start, n))
    return spans


class TranscriptionModel:
    """A loaded Whisper checkpoint: processor, model, checks, and the asr stage that runs it."""

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 config: AsrConfig = AsrConfig()):
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self.name = name
        self.config = config
        self.processor = WhisperProcessor.from_pretrained(path)
        # transformers' PreTrainedModel.to is @wraps-decorated: to mypy its first argument is `self`
        model = WhisperForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)).to(
            device).eval()  # type: ignore[arg-type]
        self.stage = AsrStage(name, model, self.processor, max_windows=config.max_windows,
                              max_new_tokens=config.max_new_tokens, encoder_batch=config.encoder_batch)
        self.english_only = not self.stage.tokens.languages
        self.weights_id = f"{ASR_FAMILY}:{path}"

    @property
    def tasks(self) -> tuple[str, ...]:
        return (SPEECH_TO_TEXT_TASK,) if self.english_only else (SPEECH_TO_TEXT_TASK, TRANSLATIONS_TASK)

    def language_code(self, language: str | None) -> str | None:
        """The request's language as the model's code; None: detect (multilingual) or none needed (English-only)."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        if language is None or not language.strip():
            return None
        code = language.strip().lower()
        code = TO_LANGUAGE_CODE.get(code, code)
        if self.english_only:
            if code != "en":
                raise RequestError("language", f"model {self.name} is English-only; send language 'en' or omit it "
                                               f"(got {language!r})", code="unsupported_language")
            return None
        if f"<|{code}|>" not in self.stage.tokens.languages:
            known = sorted(k[2:-2] for k in self.stage.tokens.languages)
            raise RequestError("language", f"language {language!r} is not one of model {self.name}'s "
                                           f"{len(known)} languages (ISO-639-1 codes: {', '.join(known[:20])}"
                                           f"{', ...' if len(known) > 20 else ''})", code="unsupported_language")
        return code

    def check(self, request: TranscriptionFields) -> tuple[str | None, tuple[int, ...]]:
        """The cheap checks, on the request's fields alone (before its audio is decoded or any model work):
        (language code or None, prompt token ids)."""
        if request.task not in (TRANSCRIBE, TRANSLATE):
            raise ValueError(f"task must be {TRANSCRIBE!r} or {TRANSLATE!r}, got {request.task!r}")
        if request.task == TRANSLATE and self.english_only:
            raise RequestError("model", f"model {self.name} is English-only and cannot translate; use "
                                        "/v1/audio/transcriptions, or a multilingual Whisper model",
                               code="unsupported_task")
        if not 0.0 <= request.temperature <= 1.0:
            raise RequestError("temperature", f"temperature must be between 0 and 1; got {request.temperature}")
        language = self.language_code(request.language)
        return language, self._prompt_ids(request.prompt)

    def _prompt_ids(self, prompt: str | None) -> tuple[int, ...]:
        if not prompt or not prompt.strip():
            return ()
        if len(prompt) > self.config.max_prompt_chars:
            raise RequestError("prompt", f"prompt is {len(prompt)} characters; the limit is "
                                         f"{self.config.max_prompt_chars}", code="prompt_too_long")
        try:
            ids = [int(t) for t in self.processor.tokenizer.get_prompt_ids(prompt, return_tensors="np")]
        except ValueError as e:  # the text spells a special token
            raise RequestError("prompt", f"prompt: {e}") from None
        keep = self.config.max_prompt_tokens
        return tuple(ids[:1] + ids[1:][-keep:]) if keep else ()  # <|startofprev|> + the last `keep` tokens

    def job(self, request: TranscriptionRequest) -> AsrJob:
        """Check and cut into windows: what the asr stage runs (it computes the log-mel features)."""
        language, prompt_ids = self.check(request)
        audio = np.asarray(request.audio, dtype=np.float32)
        if audio.ndim != 1 or not len(audio):
            raise RequestError("file", "the audio holds no samples")
        spans = cut_windows(audio, search_s=self.config.cut_search_s)
        windows = tuple(AudioWindow(audio[a:b], a / SAMPLE_RATE, (b - a) / SAMPLE_RATE) for a, b in spans)
        return AsrJob(windows=windows, task=request.task, language=language, prompt_ids=prompt_ids,
                      temperature=float(request.temperature), timestamps=request.timestamps, stream=request.stream,
                      duration_s=len(audio) / SAMPLE_RATE)

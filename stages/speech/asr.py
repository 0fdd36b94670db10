"""The asr stage: 30 s windows of concurrent requests share one decode loop (and, on a GPU, encoder forwards).

A batch of work items (requests with equal task, language and temperature) is flattened into
its windows; up to `max_windows` windows go through the encoder (`encoder_batch` at a time)
and then through one token loop (stages/speech/asr_decode.py), rows grouped by decoder-prefix length. Tokens are
scattered back to their request and window; each request's transcript is assembled in window
order (stages/speech/asr_transcript.py). Streaming requests get text deltas as tokens are chosen; a
stopped request's rows leave the loop at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from stages.events import EventKind
from stages.speech.asr_decode import EncodeStopped, WhisperTokens, decode, detect_languages, encode
from stages.speech.asr_transcript import AudioWindow, DecodedWindow, Segment, TranscriptStream, window_segments
from stages.stage import Stage, WorkItem


@dataclass(frozen=True)
class AsrJob:
    """What one transcription or translation request runs (the ExecutionRequest of the asr graph)."""

    windows: tuple[AudioWindow, ...]  # the audio, cut into <= 30 s windows, in order
    task: str  # "transcribe" or "translate" (to English)
    language: str | None  # language code ("de"); None: English-only model, or detect per window
    prompt_ids: tuple[int, ...]  # <|startofprev|> + prompt tokens, or () without a prompt
    temperature: float  # 0: greedy; > 0: sampling at that temperature
    timestamps: bool  # predict timestamp tokens (segment times inside windows); else one segment per window
    stream: bool  # emit DELTA events {"text": ...} as text is decoded
    duration_s: float  # length of the audio


@dataclass(frozen=True)
class _Row:
    item: int  # index of its work item in the batch
    window: int  # index of its window in that item's job


def _emit_delta(item: WorkItem) -> Callable[[str], None]:
    """A streaming request's transcript deltas, as events of its work item."""
    def emit(text: str) -> None:
        item.emit(EventKind.DELTA, text=text)
    return emit


class AsrStage(Stage):
    kind = "asr"

    def __init__(self, name: str, model, processor, *, max_windows: int, max_new_tokens: int | None,
                 encoder_batch: int | None = None):
        self.model = name
        self.whisper = model
        self.feature_extractor = processor.feature_extractor
        self.tokenizer = processor.tokenizer
        self.tokens = WhisperTokens.of(model)
        self.max_windows = max_windows  # windows in one decode loop
        # Windows in one encoder forward. On a CPU the encoder is compute-bound and a batch is no faster
        # than its windows one by one (its 1500 x 1500 attention maps only thrash the caches): 1 there.
        self.encoder_batch = encoder_batch or (1 if model.device.type == "cpu" else max_windows)
        self.max_new_tokens = max_new_tokens or self.tokens.max_positions  # per window
        self.languages = {v: k[2:-2] for k, v in self.tokens.languages.items()}  # token id -> "de"

    def batch_key(self, item: WorkItem) -> Hashable:
        job: AsrJob = item.inputs["request"]
        return job.task, job.language, job.temperature

    def text_of(self, ids: list[int]) -> str:
        """Text of some decoded tokens; special and timestamp tokens are not text."""
        begin = self.tokens.timestamp_begin
        return self.tokenizer.decode([t for t in ids if t < begin], skip_special_tokens=True)

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        jobs: list[AsrJob] = [item.inputs["request"] for item in items]
        # 1. every window of every request, and a delta stream for each streaming request
        rows = [_Row(i, w) for i, job in enumerate(jobs) for w in range(len(job.windows))]
        streams = {i: TranscriptStream(len(job.windows), self.text_of, self.tokens.eot, _emit_delta(items[i]))
                   for i, job in enumerate(jobs) if job.stream}
        decoded: dict[_Row, DecodedWindow] = {}
        # 2. chunks of up to max_windows windows: features, encoder, then one token loop per prefix length
        for start in range(0, len(rows), self.max_windows):
            chunk = [r for r in rows[start:start + self.max_windows] if not items[r.item].request.should_stop()]
            if chunk:
                decoded.update(self._run_windows(chunk, items, jobs, streams))
        # 3. per request, in window order: segments and text
        return [self._transcript(i, job, decoded) if not items[i].request.should_stop() else {}
                for i, job in enumerate(jobs)]

    def _run_windows(self, chunk: list[_Row], items, jobs, streams) -> dict[_Row, DecodedWindow]:
        # log-mel features here, not at submit: a request joins a batch the moment it arrives
        windows = [jobs[r.item].windows[r.window].samples for r in chunk]
        features = torch.from_numpy(self.feature_extractor(windows, sampling_rate=self.feature_extractor.sampling_rate,
                                                           return_tensors="np").input_features)  # [n, n_mels, 3000]
        stopped = lambda: all(items[r.item].request.should_stop() for r in chunk)  # noqa: E731
        try:
            enc = torch.cat([encode(self.whisper, features[k:k + self.encoder_batch], stopped)
                             for k in range(0, len(chunk), self.encoder_batch)])  # [n, 1500, d_model]
        except EncodeStopped:  # every request of the chunk was cancelled: they leave without outputs
            return {}
        languages = self._languages(chunk, jobs, enc)
        prefixes = [list(jobs[r.item].prompt_ids) + self.tokens.init_tokens(
            language=self.tokens.languages.get(f"<|{lang}|>"), task=jobs[r.item].task,
            timestamps=jobs[r.item].timestamps) for r, lang in zip(chunk, languages)]
        groups: dict[tuple[int, bool], list[int]] = {}
        for k, (r, prefix) in enumerate(zip(chunk, prefixes)):
            groups.setdefault((len(prefix), jobs[r.item].timestamps), []).append(k)
        out: dict[_Row, DecodedWindow] = {}
        for (_, timestamps), members in groups.items():
            group_rows = [chunk[k] for k in members]

            def on_step(live: list[int], picked: list[int], _logprobs: list[float], group_rows=group_rows) -> list[int]:
                for row_index, token in zip(live, picked):
                    r = group_rows[row_index]
                    if r.item in streams:
                        streams[r.item].add(r.window, token)
                return [k for k in live if items[group_rows[k].item].request.should_stop()]

            # all rows of a batch share task, language and temperature (the batch key)
            tokens, logprobs, no_speech = decode(
                self.whisper, enc[members], [prefixes[k] for k in members], timestamps=timestamps,
                temperature=jobs[group_rows[0].item].temperature, max_new_tokens=self.max_new_tokens,
                tokens=self.tokens, on_step=on_step)
            for j, r in enumerate(group_rows):
                if r.item in streams:
                    streams[r.item].finish(r.window)  # windows that ran out of tokens end here too
                out[r] = DecodedWindow(tuple(tokens[j]), tuple(logprobs[j]), no_speech[j],
                                       languages[members[j]])
        return out

    def _languages(self, chunk: list[_Row], jobs: list[AsrJob], enc: torch.Tensor) -> list[str]:
        """The language code of each window: the request's, English for English-only models, else detected."""
        if not self.tokens.languages:
            return ["en"] * len(chunk)
        unknown = [k for k, r in enumerate(chunk) if jobs[r.item].language is None]
        detected = dict(zip(unknown, detect_languages(self.whisper, enc[unknown], self.tokens))) if unknown else {}
        codes: list[str] = []
        for k, r in enumerate(chunk):
            code = self.languages[detected[k]] if k in detected else jobs[r.item].language
            assert code is not None  # windows of requests without a language were detected
            codes.append(code)
        return codes

    def _transcript(self, i: int, job: AsrJob, decoded: dict[_Row, DecodedWindow]) -> dict[str, Any]:
        """Outputs: {"text", "segments": [Segment], "language", "duration", "windows": [DecodedWindow]}."""
        windows = [decoded[_Row(i, w)] for w in range(len(job.windows))]
        segments: list[Segment] = []
        for window, result in zip(job.windows, windows):
            segments += window_segments(result, window, timestamps=job.timestamps,
                                        timestamp_begin=self.tokens.timestamp_begin, eot=self.tokens.eot,
                                        temperature=job.temperature, text_of=self.text_of, first_id=len(segments))
        text = "".join(s.text for s in segments).strip()
        return {"text": text, "segments": segments, "language": windows[0].language if windows else "en",
                "duration": job.duration_s, "windows": windows}

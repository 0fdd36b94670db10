"""Shapes the published API schema names that no route declares itself: the replies, the error object,
the multipart forms, and the JSON bodies of the routes that read `request.json()` themselves.

Nothing here validates a request or builds a reply: these models exist so that /openapi.json says
what the server answers (serve/openapi.py places them). Each mirrors the code that builds the
real thing, named beside it; the schemathesis test (tests/test_openapi_conformance.py) checks the
server's answers against them.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from serve.routes.videos import VideoBody
from serve.schemas import ImageEditRequest

# -- errors (serve/errors.py error_body) ---------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str  # says what to change, naming the field and the limit
    type: str  # invalid_request_error, rate_limit_error, service_unavailable_error, server_error, ...
    param: str | None  # the offending request field, when one is to blame
    code: str | None  # machine-readable: missing_required_parameter, model_not_found, request_too_large, ...


class Error(BaseModel):
    """OpenAI's error object, the body of every 4xx and 5xx answer."""

    error: ErrorDetail


# -- system (serve/routes/system.py) -------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    ready: bool
    models: list[str]  # every configured model id
    error: str | None = None  # why loading failed (only then)
    status: Literal["ok", "degraded", "down"] | None = None  # once loaded: degraded while a lost replica restarts
    down: list[str] | None = None  # "down": the models a stage of which has no live replica


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    family: str  # extension: sd, sdxl, causal-lm, whisper, ...
    tasks: list[str]  # extension: text-to-image, chat, embeddings, speech-to-text, ...
    # extension: a demo/test checkpoint (noise out); a default only when nothing else does the task
    random_weights: bool
    # extension: "stage-graph" (mmserve's stages) or "pipeline" (a diffusers pipeline's own __call__, one request at a
    # time: no step batching, caches or graphs)
    execution: Literal["stage-graph", "pipeline"]
    voices: list[str] | None = None  # extension: text-to-speech models only
    adapters: list[str] | None = None  # extension: the LoRA adapters a request may name
    parent: str | None = None  # extension: a "base:adapter" id's base model
    quantization: dict[str, str] | None = None  # extension: diffusion components -> method ("int8wo", "gguf", ...)
    resident_bytes: int | None = None  # extension: diffusion models: bytes of the weights as loaded


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Lora(BaseModel):  # serve/routes/loras.py
    object: Literal["lora"]
    id: str  # the adapter's name
    model: str  # its base model
    path: str  # the file or directory it was loaded from
    scale: float  # its weight in a request that names none
    resident: bool  # its weights are in the model now (false: evicted by the byte budget; reloaded on demand)
    bytes: int  # of its weights
    requests: int  # running requests that hold it


class LoraList(BaseModel):
    object: Literal["list"]
    data: list[Lora]


class LoraDeleted(BaseModel):
    object: Literal["lora"]
    id: str
    model: str
    deleted: Literal[True]
    unloaded: bool  # false: requests still use it; its weights go when the last of them ends


# -- images (serve/responses.py respond) ---------------------------------------------------------


class B64Image(BaseModel):
    b64_json: str  # the encoded image (output_format), base64


class UrlImage(BaseModel):
    url: str  # GET it from /v1/files/images/{name}


class ImagesResponse(BaseModel):
    created: int
    data: list[Union[B64Image, UrlImage]]
    output_format: str
    size: str  # "WxH"
    seed: int  # extension: the seed that reproduces this reply


class ImageReference(BaseModel):
    """An image in a JSON edit request: a data: URI or URL (or {"url": ...}, as chat messages spell it)."""

    image_url: str | dict[str, str]


class ImageEditJson(ImageEditRequest):
    """POST /v1/images/edits as JSON (serve/uploads.py read_edit_json): the images by reference."""

    # one image; several (up to [limits] max_images) for the models that edit several (Qwen-Image-Edit-Plus)
    images: list[Union[ImageReference, str]] = Field(min_length=1)
    mask: Union[ImageReference, str, None] = None


class ImageEditForm(ImageEditRequest):
    """POST /v1/images/edits as multipart/form-data (serve/uploads.py read_edit_form)."""

    image: bytes  # the image file (PNG, JPEG, WebP, ...); several as `image[]` parts, for the models that edit several
    mask: bytes | None = None  # transparent (or, without alpha, white) pixels are repainted


# -- chat and completions: the fields the request models take as Any (checked by hand) -----------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str  # data: URI, http(s):// URL or an allowed file:// URL
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(BaseModel):
    url: str
    fps: float | None = Field(None, gt=0)  # frames per second to sample
    max_frames: int | None = Field(None, ge=1)


class VideoPart(BaseModel):
    """Extension: a video for vision-language models."""

    type: Literal["video_url"]
    video_url: VideoUrl


class InputAudio(BaseModel):
    data: str  # base64 of the file
    format: Literal["wav", "mp3"]


class InputAudioPart(BaseModel):
    """OpenAI's audio input, for audio-language models."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrl(BaseModel):
    url: str  # data: URI, http(s):// URL or an allowed file:// URL (any container the media decoder reads)


class AudioUrlPart(BaseModel):
    """Extension: an audio clip by URL, for audio-language models."""

    type: Literal["audio_url"]
    audio_url: AudioUrl


class ChatMessage(BaseModel):
    """One message (pipelines/chat_parts.py checked_message); media parts only in user messages."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Union[TextPart, ImagePart, VideoPart, InputAudioPart, AudioUrlPart]] | None  # null: assistant



ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]
# /v1/completions `prompt` (serve/schemas_chat.py prompt_fields): one prompt, or a list of prompts
Prompt = Union[str, TokenIds, Annotated[list[Union[str, TokenIds]], Field(min_length=1)]]


class EmbeddingImagePart(BaseModel):
    """Extension: an image to embed (CLIP models)."""

    type: Literal["image_url"]
    image_url: str | dict[str, str]  # "<url>" or {"url": "<url>"}


# /v1/embeddings `input` (serve/routes/embeddings.py parse_input)
EmbeddingInput = Union[str, TokenIds, Annotated[list[Union[str, TokenIds, TextPart, EmbeddingImagePart]],
                                                 Field(min_length=1)]]


# -- chat and completions replies (serve/schemas_chat.py TextReply) -----------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- embeddings (serve/routes/embeddings.py reply) -----------------------------------------------


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format=base64)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


# -- audio (serve/routes/speech.py, serve/routes/transcriptions.py, serve/transcripts.py) --------


class Voice(BaseModel):
    id: str
    object: Literal["voice"]
    model: str


class VoiceList(BaseModel):
    object: Literal["list"]
    data: list[Voice]


class DurationUsage(BaseModel):
    type: Literal["duration"]
    seconds: int


class Transcription(BaseModel):
    """response_format json."""

    text: str
    usage: DurationUsage


class Segment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionVerbose(BaseModel):
    """response_format verbose_json."""

    task: str  # transcribe | translate
    language: str
    duration: float
    text: str
    segments: list[Segment]
    usage: DurationUsage


ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]  # serve/transcripts.py RESPONSE_FORMATS


class TranslationForm(BaseModel):
    """POST /v1/audio/translations (multipart/form-data; serve/routes/transcriptions.py read_audio_form)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    file: bytes  # the audio (WAV, MP3, FLAC, OGG, M4A, WebM, ...)
    model: str | None = None  # None: the first model that can
    prompt: str | None = None
    temperature: float = 0.0
    response_format: ResponseFormat = "json"


class TranscriptionForm(TranslationForm):
    """POST /v1/audio/transcriptions (multipart/form-data)."""

    language: str | None = None  # ISO-639-1; None: detected
    stream: bool = False  # SSE transcript.text.delta / transcript.text.done (json and text only)
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        None, alias="timestamp_granularities[]")  # verbose_json only; "word" is refused (not produced)
    include: list[str] | None = Field(None, alias="include[]")  # accepted, ignored
    chunking_strategy: str | None = None  # accepted, ignored


# -- videos (serve/routes/videos.py video_object) ------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    id: str
    object: Literal["video"]
    model: str | None
    status: Literal["queued", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled",
                    "expired"]
    progress: int  # 0..100
    created_at: int
    completed_at: int | None
    expires_at: int | None
    size: str | None
    seconds: str | None
    error: JobError | None


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"]
    deleted: Literal[True]


class VideoList(BaseModel):
    object: Literal["list"]
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoForm(VideoBody):
    """POST /v1/videos as multipart/form-data: the image of image-to-video as a file part."""

    input_reference: bytes | None = None  # type: ignore[assignment]


# -- files and batches (serve/routes/batches.py) -------------------------------------------------


class FileForm(BaseModel):
    """POST /v1/files (multipart/form-data)."""

    file: bytes  # JSONL, one request per line (purpose batch)
    purpose: Literal["batch", "user_data"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch, user_data, batch_output
    status: Literal["processed"]
    expires_at: int | None
    status_details: None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: None  # batch-level errors are not produced: a failed line goes to the error file
    input_file_id: str
    completion_window: str
    status: Literal["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled",
                    "expired"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- server-sent events ---------------------------------------------------------------------------


class ServerSentEvent(BaseModel):
    """One event of a `text/event-stream` reply: `data` is a JSON object (or `[DONE]`, the stream's end)."""

    event: str | None = None  # images and speech name their events; chat and completions do not
    data: str

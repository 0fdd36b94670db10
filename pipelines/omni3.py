"""Qwen3-Omni's speech half: the talker (codec code 0 of each frame from the thinker's reply, its code predictor the
other code groups) and code2wav (a causal codec decoder to 24 kHz audio), as the `talker` and `code2wav` stages after
the thinker's llm node.

What the talker reads (`Qwen3OmniMoeForConditionalGeneration.generate`): the user turns of the prompt (text
positions: the thinker's input embedding through `text_projection`; media positions: the thinker's hidden state
after `accept_hidden_layer` layers through `hidden_projection`), then the reply's start (its first tokens, the
speaker's codec id, the codec's think / pad / bos ids), then one reply token a step (then text-end, then text-pad).
It reads tokens, not the thinker's last-layer states, so for a text prompt it streams from the thinker: the llm's
deltas feed a `ReplyFeed`, which joins the talker's loop at the thinker's first token (the prompt is prefilled once
the reply's first token is fed back; step k reads reply token k + 1, there once token k + 2 is sampled or the reply
is over). The only thinker states it needs are at media
placeholders: for a prompt with media the talker stage recomputes the prompt up to its last placeholder through
those layers (`media_hidden`: the thinker's own layers over a paged cache of its own; the llm stage keeps last-layer
states only) from the encoders' features, so there it starts after the thinker's reply.

Every reply in the loop that can move takes one step together (`Talker3`): its code 0 drawn with `generate()`'s
processors, then for the replies whose next text row is there the code predictor's steps for all of them at once
(its other code groups) and one talker forward over their caches left-padded under a mask. Each reply draws from a
generator of its own seeded with the request's seed, in `generate()`'s order (code 0, then the predictor's codes), so
one seed gives `generate()`'s codes after `torch.manual_seed(seed)` (the thinker's greedy reply draws nothing).

The streamed half of code2wav (cutting the talker's frames into chunks, the stage) is in `pipelines/omni3_code2wav.py`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipelines.omni import SpeechOutput
from pipelines.omni_talker import FedTalkerStage, ThinkerFeed
from stages.events import EventKind
from stages.llm import attention
from stages.llm.multimodal import MediaSpan, attach_features, in_span_order, mrope_positions, splice
from stages.llm.stage import GenerationRequest
from stages.stage import WorkItem

SAMPLE_RATE = 24000  # code2wav's output
DECODE_SPAN, DECODE_CONTEXT = 300, 25  # generate()'s chunked_decode: spans of 300 codes, each with 25 of left context


class ReplyFeed(ThinkerFeed):
    """A spoken request's thinker reply as the llm writes it (the llm ⇢ talker edge's splitter, one piece): the
    prompt's ids, the reply's ids, and whether it is over. Qwen3-Omni's talker reads no thinker state: the deltas'
    states are dropped."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        return super().feed({**delta, "hidden": torch.zeros(0)})

    def fed(self) -> int:
        """Reply tokens the thinker has fed back (all but the last sampled): the ones sure to be spoken."""
        return max(0, len(self.reply_ids) - 1)


class Omni3Voice:
    """The talker (with its code predictor), code2wav and speakers of a Qwen3-Omni checkpoint, beside a thinker
    loaded elsewhere (whose embeddings and first layers the talker's inputs come from)."""

    def __init__(self, path: str, thinker, *, device: str, dtype: torch.dtype = torch.float32):
        from transformers import Qwen3OmniMoeForConditionalGeneration

        # The whole checkpoint loads once more (its thinker copy is dropped below: a transient second thinker).
        full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype)
        if not full.has_talker:
            raise ValueError(f"{path}: this Qwen3-Omni checkpoint has no talker (enable_audio_output is off)")
        self.talker = full.talker.to(device).eval()
        self.code2wav = full.code2wav.to(device).eval()
        config: Any = full.config  # its sub-configs are typed as unions
        self.config = config  # the whole model's: role, tts and codec token ids
        # transformers 5.25's talker rope index reads `config.audio_config.n_window` from the talker's config, which
        # has none (a prompt with audio fails in generate()): it is the thinker's audio encoder's, set once at load.
        talker_config: Any = self.talker.config
        talker_config.audio_config = config.thinker_config.audio_config
        del full
        self.thinker = thinker
        self.device = torch.device(device)
        self.hop = int(self.code2wav.total_upsample)  # samples a code
        with torch.inference_mode():  # a decode of n codes makes n * hop - lost samples (its last ones need more)
            one = torch.zeros(1, self.config.code2wav_config.num_quantizers, 1, dtype=torch.long, device=self.device)
            self.lost = self.hop - self.code2wav(one).shape[-1]
            special = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
            self.tts_bos, self.tts_eos, self.tts_pad = self.text_rows(special).unbind(0)  # [H] each

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.config.talker_config.speaker_id)

    @torch.inference_mode()
    def media_hidden(self, request: GenerationRequest, spans: tuple[MediaSpan, ...]) -> torch.Tensor:
        """The thinker's hidden states after `accept_hidden_layer` layers at every media placeholder of the prompt
        [placeholders, H]: the prompt up to its last placeholder (features spliced in, its 3-D positions) through
        the thinker's own layers, attending over a paged cache of this call's own. After all the layers,
        transformers' state is the normed one: so is this."""
        lm = self.thinker.model.language_model
        depth = self.config.talker_config.accept_hidden_layer
        where = [p for span in spans for p in range(span.offset, span.end)]
        end = max(where) + 1
        dev = lm.embed_tokens.weight.device
        embeds = self.thinker.get_input_embeddings()(torch.tensor(request.prompt_ids[:end], device=dev))
        splice(embeds, 0, 0, end, spans)
        positions = mrope_positions(request.mrope, 0, end)[:, None].to(dev)  # [3, 1, T]
        text = lm.config
        shape = (1, end, text.num_key_value_heads, text.head_dim)  # one block holding the whole prefix
        caches = [torch.zeros(shape, dtype=embeds.dtype, device=dev) for _ in range(2 * min(depth, len(lm.layers)))]
        meta = attention.PagedMetadata(
            k_caches=caches[0::2], v_caches=caches[1::2], slot_mapping=torch.arange(end, device=dev),
            query_start_loc=torch.tensor([0, end], device=dev), context_lens=torch.tensor([end], device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.long, device=dev), all_decode=end == 1, max_query_len=end)
        hidden = embeds[None]
        rotary = lm.rotary_emb(hidden, positions)
        for layer in lm.layers[:depth]:
            hidden = layer(hidden, attention_mask=None, position_ids=None, position_embeddings=rotary, paged=meta)
        if depth >= len(lm.layers):
            hidden = lm.norm(hidden)
        return hidden[0, where]

    def text_rows(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Tokens as the talker reads text: the thinker's input embeddings through `text_projection` [len, H]."""
        embed = self.thinker.get_input_embeddings()
        tokens = torch.as_tensor(ids, dtype=torch.long, device=embed.weight.device)
        return self.talker.text_projection(embed(tokens).to(self.device, self.talker.dtype))

    def assistant_start(self, prompt_ids: list[int]) -> int:
        """Where the reply's turn starts in the prompt: its last `<|im_start|>assistant`."""
        config = self.config
        return max(i for i in range(len(prompt_ids) - 1) if prompt_ids[i] == config.im_start_token_id
                   and prompt_ids[i + 1] == config.assistant_token_id)

    def talker_prompt(self, prompt_ids: list[int], head: list[int], media_hidden: torch.Tensor | None,
                      speaker: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate()`'s talker prompt for one reply: embeddings [1, T, H] and ids [1, T] (its rope index reads them)
        of the user turns (text and media rows), then the reply's start: `head` (the turn's first 4 tokens from its
        `<|im_start|>`: the role's, then the reply's first) with the speaker and the codec's control ids."""
        config, talker = self.config, self.talker
        codec = config.talker_config
        dev = self.device
        n = len(prompt_ids)
        ids = torch.tensor([prompt_ids], device=dev)  # [1, n]
        # 1. user turns: every position whose role (the token after its last <|im_start|>) is the user's
        positions = torch.arange(n, device=dev)[None]
        starts = torch.where(ids == config.im_start_token_id, positions, positions.new_full((), -1))
        roles = ids.gather(1, (torch.cummax(starts, dim=-1).values.clamp_min(0) + 1).clamp_max(n - 1))
        user = roles == config.user_token_id
        thinker = config.thinker_config
        media = torch.isin(ids, torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id],
                                             device=dev))
        user_rows = torch.zeros((1, n, codec.text_config.hidden_size), device=dev, dtype=talker.dtype)
        if media.any():
            assert media_hidden is not None  # the stage computes them for a prompt with media
            user_rows[media] = talker.hidden_projection(media_hidden.to(dev, talker.dtype))
        user_rows[~media] = self.text_rows(ids[~media])
        user_embeds, user_ids = user_rows[user][None], ids[user][None]
        # 2. the reply's start: its role tokens and first token, the speaker and the codec's control ids
        start = self.text_rows(head)[None]  # [1, 4, H]
        text_part = torch.cat((start[:, :3], self.tts_pad.expand(1, 4, -1), self.tts_bos[None, None], start[:, 3:4]),
                              dim=1)
        controls = torch.tensor([[codec.codec_nothink_id, codec.codec_think_bos_id, codec.codec_think_eos_id,
                                  codec.speaker_id[speaker], codec.codec_pad_id, codec.codec_bos_id]], device=dev)
        codec_part = torch.cat((torch.zeros((1, 3, codec.text_config.hidden_size), device=dev, dtype=talker.dtype),
                                talker.get_input_embeddings()(controls)), dim=1)
        assistant_ids = torch.full((1, text_part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=dev)
        return torch.cat((user_embeds, text_part + codec_part), dim=1), torch.cat((user_ids, assistant_ids), dim=1)

    @torch.inference_mode()
    def waveform(self, codes: torch.Tensor) -> torch.Tensor:
        """code2wav, as `generate()` decodes one reply (spans of 300 codes, 25 of left context): float32 [samples]
        at 24 kHz."""
        if codes.shape[1] == 0:
            return torch.zeros(0)
        wav = self.code2wav.chunked_decode(codes[None].to(self.device), chunk_size=DECODE_SPAN,
                                           left_context_size=DECODE_CONTEXT)
        return wav.reshape(-1).float().cpu()

    @torch.inference_mode()
    def chunks(self, windows: list[tuple[torch.Tensor, int, bool]]) -> list[torch.Tensor]:
        """Streamed chunks' samples, several replies' in one code2wav forward. Each (window [groups, codes],
        `context` codes of left context then the chunk, whether it opens a decode span) gives the chunk's share of
        its reply's waveform. The windows are right-padded to the longest: code2wav is causal, so a row's samples
        up to its own end (codes x hop - lost) do not read the padding (equal to a decode alone within float
        rounding). A decode's last `lost` samples need the codes after it: the chunk that opens a span (as
        generate() decodes it) starts at its first code's samples, a later one `lost` samples before (the ones the
        chunk before it could not make)."""
        longest = max(window.shape[1] for window, _, _ in windows)
        batch = torch.stack([F.pad(window, (0, longest - window.shape[1])) for window, _, _ in windows])
        wavs = self.code2wav(batch.to(self.device)).float().cpu()
        return [wav.reshape(-1)[context * self.hop - (0 if opens_span else self.lost):window.shape[1] * self.hop
                                - self.lost] for wav, (window, context, opens_span) in zip(wavs, windows)]

class Talker3Row:
    """A reply being spoken: its feed, the media it read (states and geometry), its own cache (unpadded) and rope
    offset, the logits of its next code 0 and the talker's last state (None while a drawn code waits to be fed), its
    drawn codes 0 (the repetition penalty's sequence), its frames and its generator."""

    def __init__(self, feed: ReplyFeed, speech: SpeechOutput, media: tuple[torch.Tensor | None, tuple, tuple],
                 on_frame: Callable[[list[int]], Any] | None, device: torch.device):
        self.feed, self.speech, self.on_frame = feed, speech, on_frame
        self.media_hidden, self.audio_frames, self.image_grids = media
        self.head: list[int] = []  # the prompt from the reply turn's <|im_start|> (set at open)
        self.cache: Any = None
        self.delta = 0  # 3-D position - cache position (the talker's rope index)
        self.logits: torch.Tensor | None = None  # [1, V]
        self.hidden: torch.Tensor | None = None  # [1, 1, H]
        self.code: int | None = None  # code 0 drawn, waiting to be fed
        self.sequence: list[int] = []
        self.frames: list[list[int]] = []
        self.generator = torch.Generator(device).manual_seed(speech.seed)
        self.finished = False

    @property
    def length(self) -> int:  # positions in its cache
        return self.cache.layers[0].keys.shape[2]

    def draw(self, probs: torch.Tensor) -> int:
        """A code drawn from `probs` [1, V] with this row's generator, as generate()'s multinomial draws alone."""
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])

    def codes(self, groups: int) -> torch.Tensor:
        """Its frames as code2wav reads them [groups, frames]."""
        if not self.frames:
            return torch.zeros(groups, 0, dtype=torch.long)
        return torch.tensor(self.frames, dtype=torch.long).T


class Talker3:
    """The talker's steps over rows: opening (the prompt, prefilled alone), drawing code 0, feeding (the code
    predictor's steps, then one talker forward), each with `generate()`'s sampling."""

    def __init__(self, voice: Omni3Voice, max_codes: int):
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.voice, self.max_codes = voice, max_codes  # max_codes: generate()'s talker_max_new_tokens
        codec = voice.config.talker_config
        vocab = codec.text_config.vocab_size
        self.groups, self.eos = codec.num_code_groups, codec.codec_eos_token_id
        # generate()'s talker sampling, in its order: repetition penalty 1.05 over the codes drawn, the codec's
        # control ids (its top 1024) suppressed but its eos, temperature 0.9, top-k 50 (top-p 1.0: none)
        self.penalty = RepetitionPenaltyLogitsProcessor(1.05)
        self.processors = (SuppressTokensLogitsProcessor([i for i in range(vocab - 1024, vocab) if i != self.eos],
                                                         device=str(voice.device)),
                           TemperatureLogitsWarper(0.9), TopKLogitsWarper(50))
        # the code predictor's (the talker's prepare_inputs_for_generation): its generation config's temperature,
        # top-k 50, top-p 0.8
        temperature = voice.talker.code_predictor.generation_config.temperature
        self.predictor_processors = ((TemperatureLogitsWarper(temperature),) if temperature not in (None, 1.0) else
                                     ()) + (TopKLogitsWarper(50), TopPLogitsWarper(0.8))

    def text(self, row: Talker3Row, i: int) -> int | torch.Tensor | None:
        """Token i of the reply's turn as the talker reads it (its `<|im_start|>` is token 0): a token id while the
        thinker has fed it back, then text-end's row, then text-pad's; None while it may still come."""
        feed = row.feed
        with feed.wake:
            fed, done = feed.fed(), feed.done
            if i < len(row.head):
                return row.head[i]
            if i - len(row.head) < fed:
                return feed.reply_ids[i - len(row.head)]
        if not done:
            return None
        return self.voice.tts_eos if i == len(row.head) + fed else self.voice.tts_pad

    def can_open(self, row: Talker3Row) -> bool:
        feed = row.feed
        with feed.wake:
            if feed.prompt_ids is None:
                return False
            if not row.head:
                row.head = feed.prompt_ids[self.voice.assistant_start(feed.prompt_ids):]
        return feed.done or isinstance(self.text(row, 3), int)

    def can_move(self, row: Talker3Row) -> bool:
        """A step would advance it: open it, draw its next code 0, or feed the code it drew."""
        if row.finished:
            return False
        if row.cache is None:
            return self.can_open(row)
        return row.logits is not None or self.text(row, 4 + len(row.frames)) is not None

    def can_feed(self, row: Talker3Row) -> bool:
        """Its drawn code 0 waits to be fed, and the text it adds is there (or the reply is over)."""
        return row.code is not None and self.text(row, 4 + len(row.frames)) is not None

    def open(self, row: Talker3Row) -> None:
        """The talker's prompt (`Omni3Voice.talker_prompt`), prefilled alone at generate()'s positions (its rope
        index over the prompt's media). A reply whose turn has no fed token says nothing (generate() needs one)."""
        from transformers import DynamicCache

        voice, talker = self.voice, self.voice.talker
        head = [self.text(row, i) for i in range(4)]
        if not all(isinstance(token, int) for token in head):
            row.finished = True
            return
        prompt_ids = row.feed.prompt_ids
        assert prompt_ids is not None
        embeds, ids = voice.talker_prompt(prompt_ids, head, row.media_hidden, row.speech.voice)  # type: ignore[arg-type]
        mask = torch.ones(ids.shape, dtype=torch.long, device=voice.device)
        positions = torch.arange(ids.shape[1], device=voice.device)[None, None]
        if row.audio_frames or row.image_grids:
            grids = torch.tensor(row.image_grids, device=voice.device) if row.image_grids else None
            frames = torch.tensor(row.audio_frames, device=voice.device) if row.audio_frames else None
            rope, deltas = talker.get_rope_index(ids, grids, None, mask, False, frames, None)
            row.delta = int(deltas[0, 0])
        else:
            rope = positions.expand(3, 1, -1)
        out = talker.model(inputs_embeds=embeds, attention_mask=mask, position_ids=torch.cat((positions, rope)),
                           cache=DynamicCache(), use_cache=True)
        row.cache, row.hidden = out.cache, out.last_hidden_state[:, -1:]
        row.logits = talker.codec_head(out.last_hidden_state)[:, -1].float()

    def sample(self, rows: list[Talker3Row]) -> None:
        """generate()'s draw of each row's next code 0 (the repetition penalty over each row's own codes, the other
        processors over all rows at once), each from the row's generator. A row ends at the codec's eos or once it
        drew `max_codes` (generate()'s last draw is never fed)."""
        scores = torch.cat([self.penalty(torch.tensor([row.sequence], dtype=torch.long, device=self.voice.device),
                                         row.logits) for row in rows if row.logits is not None])
        for process in self.processors:
            scores = process(None, scores)  # these read the scores only
        probs = torch.softmax(scores, dim=-1)
        for b, row in enumerate(rows):
            code = row.draw(probs[b:b + 1])
            row.sequence.append(code)
            row.logits = None
            row.finished = code == self.eos or len(row.sequence) >= self.max_codes
            row.code = None if row.finished else code

    def feed(self, rows: list[Talker3Row]) -> None:
        """The rows' drawn codes fed: the code predictor's steps for all of them (its prefill of the talker's last
        state and the code's embedding, then one code group a step, each row drawing from its generator), then one
        talker forward of each frame's embeddings (summed) plus the reply's next text row, each row at its own
        position over the rows' caches left-padded to one length."""
        from transformers import DynamicCache

        voice, talker = self.voice, self.voice.talker
        device = voice.device
        texts = [self.text(row, 4 + len(row.frames)) for row in rows]
        tokens = [t for t in texts if isinstance(t, int)]
        projected = iter(voice.text_rows(tokens) if tokens else ())
        text = torch.stack([next(projected) if isinstance(t, int) else t for t in texts])[:, None]  # type: ignore[misc]
        # the code predictor: generate() of num_code_groups - 1 codes, for every row at once
        predictor = talker.code_predictor
        frames: list[list[int]] = [[row.code] for row in rows if row.code is not None]
        states = [row.hidden for row in rows if row.hidden is not None]
        codes = torch.tensor(frames, device=device)  # [B, 1]
        parts = [talker.get_input_embeddings()(codes)]  # each code's embedding [B, 1, H]
        cache = DynamicCache()
        hidden = predictor.model(inputs_embeds=torch.cat([torch.cat(states), parts[0]], dim=1), cache=cache,
                                 use_cache=True).last_hidden_state
        for step in range(1, self.groups):
            scores = predictor.lm_head[step - 1](hidden)[:, -1].float()
            for process in self.predictor_processors:
                scores = process(None, scores)
            probs = torch.softmax(scores, dim=-1)
            drawn = [row.draw(probs[b:b + 1]) for b, row in enumerate(rows)]
            for frame, code in zip(frames, drawn):
                frame.append(code)
            parts.append(predictor.model.codec_embedding[step - 1](torch.tensor(drawn, device=device)[:, None]))
            if step < self.groups - 1:
                hidden = predictor.model(inputs_embeds=parts[-1], cache=cache, use_cache=True).last_hidden_state
        embeds = torch.cat(parts, dim=1).sum(1, keepdim=True) + text.to(device, talker.dtype)
        # the talker's step
        longest = max(row.length for row in rows)
        padded = DynamicCache()
        for layer in range(len(rows[0].cache.layers)):
            keys, values = [], []
            for row in rows:
                pad = longest - row.length
                keys.append(torch.nn.functional.pad(row.cache.layers[layer].keys, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(row.cache.layers[layer].values, (0, 0, pad, 0)))
            padded.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.zeros(len(rows), longest + 1, dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            mask[b, longest - row.length:] = 1
        positions = torch.tensor([[row.length + row.delta] for row in rows], device=device)
        out = talker.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
                           cache=padded, use_cache=True)
        logits = talker.codec_head(out.last_hidden_state)[:, -1].float()
        for b, (row, frame) in enumerate(zip(rows, frames)):
            pad = longest - row.length
            for kept, layer in zip(out.cache.layers, row.cache.layers):
                layer.keys, layer.values = kept.keys[b:b + 1, :, pad:], kept.values[b:b + 1, :, pad:]
            row.hidden, row.logits, row.code = out.last_hidden_state[b:b + 1, -1:], logits[b:b + 1], None
            row.frames.append(frame)
            if row.on_frame is not None:
                row.on_frame(frame)


class Talker3Stage(FedTalkerStage):
    """The talker's loop: a reply joins once its turn's first tokens are there (a `ReplyFeed` piece streamed from
    the thinker; for a prompt with media, with the encoders' features, done before the thinker started) and steps
    with the others; a streamed reply's frames go out as DELTAs {"codes": [frame]} (a frame: one code of each
    group). Its outputs are the codes [groups, frames]."""

    feed_class = ReplyFeed

    def __init__(self, model: str, voice: Omni3Voice, max_codes: int = 4096):
        super().__init__(model, voice, Talker3(voice, max_codes))

    def start(self, item: WorkItem) -> None:
        speech: SpeechOutput = item.inputs["speech"]
        request: GenerationRequest = item.inputs["request"]  # a prompt with media: the one media_decode planned
        media: tuple[torch.Tensor | None, tuple, tuple] = (None, (), ())
        if request.media:  # the thinker's states at the placeholders, recomputed from the encoders' features
            features = in_span_order(request.media, item.inputs.get("features"), item.inputs.get("audio_features"))
            spans = attach_features(request.media, features, num_tokens=len(request.prompt_ids),
                                    hidden_size=self.voice.thinker.config.text_config.hidden_size)
            tasks = (*item.inputs.get("media", ()), *item.inputs.get("audio_media", ()))
            media = (self.voice.media_hidden(request, spans),
                     tuple(t.geometry.audio_frames for t in tasks if t.geometry.kind == "audio"),
                     tuple(t.geometry.grid_thw for t in tasks if t.geometry.kind == "image"))
        told = (lambda frame: item.emit(EventKind.DELTA, codes=[frame])) if speech.stream else None
        item.state["row"] = Talker3Row(item.inputs["thinker"], speech, media, told, self.voice.device)

    def finish(self, item: WorkItem) -> dict[str, Any]:
        row: Talker3Row = item.state.pop("row")
        return {"codes": row.codes(self.talker.groups)}

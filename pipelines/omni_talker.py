"""Qwen2.5-Omni's talker as a loop stage that the thinker feeds while it writes: a streaming edge from the llm node.

The talker reads, per position, the thinker's last hidden state plus the token's input embedding (zero at media
placeholders), as `Qwen2_5OmniForConditionalGeneration.generate` builds it (docs/omni.md): its prompt is the
thinker's prompt, the speaker's bos embedding and the first reply token; the code it feeds at step i adds reply
token i + 1's sum (then text-end once the reply is over, then text-pad for ever). So the talker runs two tokens
behind the thinker: the llm's deltas carry each fed token's state (`GenerationRequest.keep_hidden`) into a
`ThinkerFeed`, whose one piece joins the talker's loop at the thinker's first token.

Every reply in the loop that can move takes one step together: generate()'s sampling over all of them at once,
each drawing from its own generator stream seeded with the request's seed (so one seed gives generate()'s codes
after `torch.manual_seed(seed)`), then one forward for those whose next reply token is there, over their caches
left-padded to one length under an attention mask. A reply waiting on its thinker sits the step out.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import torch

from pipelines.omni import OmniVoice, SpeechOutput, reply_generator
from stages.events import EventKind, StageError
from stages.stage import LoopStage, WorkItem

WAIT_S = 0.01  # a loop whose every reply waits on its thinker sleeps this long at most (new replies join after it)


class ThinkerFeed:
    """One spoken request's thinker reply as the llm writes it: the prompt's ids, the reply's ids, the last hidden
    state of every fed token (the prompt's, then each reply token's once the next one is sampled), and whether the
    reply is over. It is the talker edge's splitter (one piece, cut at the llm's first delta, that carries the feed)
    and the record that piece's talker reads as it grows."""

    def __init__(self, wake: threading.Condition):
        self.wake = wake  # the talker stage's: told of every change
        self.prompt_ids: list[int] | None = None
        self.reply_ids: list[int] = []
        self.hidden: list[torch.Tensor] = []  # [H] rows: prompt, then fed reply tokens
        self.done = False

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        with self.wake:
            first = self.prompt_ids is None
            if first:
                self.prompt_ids = list(delta["prompt_ids"])
            self.reply_ids.append(delta["token_id"])
            self.hidden.extend(delta["hidden"].unbind(0))
            self.wake.notify_all()
        return [{"thinker": self}] if first else []

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        choice = outputs["choices"][0]
        choice.pop("hidden", None)  # the states came with the deltas; they stay inside the graph
        with self.wake:
            if self.prompt_ids is None:
                raise StageError("internal_error", "the thinker ended without a delta for its talker")
            self.reply_ids = list(choice["token_ids"])
            self.done = True
            self.wake.notify_all()
        return []

    def fed(self) -> int:
        """Reply tokens whose states are here."""
        assert self.prompt_ids is not None
        return len(self.hidden) - len(self.prompt_ids)


class TalkerRow:
    """A reply being spoken: its feed, its own cache (unpadded), the logits of its next code (None while a drawn code
    waits to be fed), its codes, its sequence (for the repetition penalty) and its generator."""

    def __init__(self, feed: ThinkerFeed, speech: SpeechOutput, on_code: Callable[[int], Any] | None,
                 device: torch.device):
        self.feed, self.speech, self.on_code = feed, speech, on_code
        self.cache: Any = None
        self.logits: torch.Tensor | None = None
        self.sequence: list[int] = []
        self.codes: list[int] = []
        self.generator = reply_generator(device, speech.seed)
        self.group: TalkerGroup | None = None  # the rows it was last fed with
        self.finished = False

    @property
    def length(self) -> int:  # positions in its cache
        return self.cache.layers[0].keys.shape[2]

    def draw(self, probs: torch.Tensor) -> int:
        """A code drawn from `probs` [1, V] with this row's stream, as generate()'s multinomial draws alone."""
        code = int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
        self.sequence.append(code)
        return code


class Talker:
    """The talker's steps over rows: opening (the prompt, prefilled alone), sampling, feeding codes."""

    def __init__(self, voice: OmniVoice, max_codes: int):
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.voice, self.max_codes = voice, max_codes
        talker = voice.talker
        # generate()'s sampling, in its order: repetition penalty 1.05 over the whole sequence, the start token
        # suppressed, temperature 0.9, top-k 40, top-p 0.8
        self.processors = (RepetitionPenaltyLogitsProcessor(1.05),
                           SuppressTokensLogitsProcessor([talker.codec_bos_token], device=str(voice.device)),
                           TemperatureLogitsWarper(0.9), TopKLogitsWarper(40), TopPLogitsWarper(0.8))
        self.media = {voice.config.audio_token_id, voice.config.image_token_id, voice.config.video_token_id}

    def _embedded(self, token: int) -> torch.Tensor:
        embed = self.voice.thinker.get_input_embeddings()
        return embed(torch.tensor([token], device=embed.weight.device)).float()[0]

    def reply(self, row: TalkerRow, i: int) -> torch.Tensor | None:
        """What reply token i adds to the talker's input [H]: its state plus its embedding while the thinker has fed
        it; text-end right after the reply's last fed token, text-pad after that; None while it may still come."""
        feed = row.feed
        with feed.wake:
            fed, done = feed.fed(), feed.done
            if i < fed:
                state, token = feed.hidden[len(feed.prompt_ids or ()) + i], feed.reply_ids[i]
        if i < fed:
            return state.float().to(self.voice.device) + self._embedded(token).to(self.voice.device)
        if not done:
            return None
        talker = self.voice.talker
        return self._embedded(talker.text_eos_token if i == fed else talker.text_pad_token).to(self.voice.device)

    def can_open(self, row: TalkerRow) -> bool:
        return row.feed.prompt_ids is not None and (row.feed.fed() >= 1 or row.feed.done)

    def can_move(self, row: TalkerRow) -> bool:
        """A step would advance it: open it, draw its next code, or feed the code it drew."""
        if row.finished:
            return False
        if row.cache is None:
            return self.can_open(row)
        return row.logits is not None or row.feed.done or row.feed.fed() >= len(row.codes) + 1

    def can_feed(self, row: TalkerRow) -> bool:
        """Its drawn code waits to be fed, and the reply token it adds is there (or the reply is over)."""
        return row.cache is not None and row.logits is None and not row.finished and \
            (row.feed.done or row.feed.fed() >= len(row.codes) + 1)

    def open(self, row: TalkerRow) -> None:
        """The talker's prompt, prefilled alone: per thinker prompt position its state plus its input embedding,
        then the speaker's bos embedding, then reply token 0's sum. A reply of one sampled token fed nothing: it
        says nothing."""
        from transformers import DynamicCache

        feed, voice = row.feed, self.voice
        assert feed.prompt_ids is not None
        if feed.fed() == 0:  # done with nothing fed
            row.finished = True
            return
        first = self.reply(row, 0)
        embed = voice.thinker.get_input_embeddings()
        n = len(feed.prompt_ids)
        tokens = embed(torch.tensor(feed.prompt_ids, dtype=torch.long, device=embed.weight.device)).float()
        tokens[torch.tensor([t in self.media for t in feed.prompt_ids])] = 0  # media rows: zeroed
        with feed.wake:
            states = torch.stack(feed.hidden[:n]).to(tokens)
        bos = self._embedded(voice.speakers[row.speech.voice]["bos_token"])
        assert first is not None
        prompt = torch.cat([(states + tokens).to(voice.device), bos[None].to(voice.device), first[None]])
        talker = voice.talker
        out = talker(inputs_embeds=prompt[None].to(talker.dtype), cache=DynamicCache(), use_cache=True)
        row.cache, row.logits = out.cache, out.logits[:, -1].float()
        row.sequence = [talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]

    def sample(self, rows: list[TalkerRow]) -> None:
        """generate()'s sampling of each row's next code: the processors over all rows at once (each row's sequence
        padded with its own first id, which the repetition penalty then counts no more than once), then one draw
        per row from the row's own stream. A row ends at the codec's end or pad code, or at `max_codes`."""
        device = self.voice.device
        longest = max(len(row.sequence) for row in rows)
        ids = torch.tensor([row.sequence + row.sequence[:1] * (longest - len(row.sequence)) for row in rows],
                           device=device)
        scores = torch.cat([row.logits for row in rows if row.logits is not None])
        for process in self.processors:
            scores = process(ids, scores)
        probs = torch.softmax(scores, dim=-1)
        talker = self.voice.talker
        for b, row in enumerate(rows):
            code = row.draw(probs[b:b + 1])
            row.logits = None
            if code in (talker.codec_pad_token, talker.codec_eos_token):  # the codec's end
                row.finished = True
                continue
            row.codes.append(code)
            if row.on_code is not None:
                row.on_code(code)
            row.finished = len(row.codes) >= self.max_codes

    def feed(self, rows: list[TalkerRow]) -> None:
        """One forward for rows whose drawn code can be fed: the code plus its reply input, each row at its own
        position, over the rows' caches left-padded to one length under an attention mask. The same rows as the
        step before go on in that step's padded cache (`TalkerGroup`); other rows are padded afresh."""
        talker, device = self.voice.talker, self.voice.device
        replies = [self.reply(row, len(row.codes)) for row in rows]
        group = rows[0].group
        if group is None or not group.holds(rows):
            group = TalkerGroup(rows, device)
        codes = torch.tensor([[row.codes[-1]] for row in rows], device=device)
        embeds = talker.get_input_embeddings()(codes) + torch.stack(replies).to(talker.dtype)[:, None]  # type: ignore[arg-type]
        positions = torch.tensor([[row.length] for row in rows], device=device)
        mask = group.grow()
        out = talker(inputs_embeds=embeds, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
                     cache=group.cache, use_cache=True)
        group.cache = out.cache
        for b, row in enumerate(rows):
            pad = group.pads[b]
            for layer, kept in zip(row.cache.layers, out.cache.layers):
                layer.keys, layer.values = kept.keys[b:b + 1, :, pad:], kept.values[b:b + 1, :, pad:]
            row.logits = out.logits[b:b + 1, -1].float()
            row.group = group


class TalkerGroup:
    """Rows fed together, their caches left-padded to one length in one cache (`cache`, under `mask`): while the
    same rows step together the next step goes on in it, and a step of other rows builds a new group."""

    def __init__(self, rows: list[TalkerRow], device: torch.device):
        from transformers import DynamicCache

        self.rows = list(rows)
        longest = max(row.length for row in rows)
        self.pads = [longest - row.length for row in rows]
        self.cache = DynamicCache()
        for layer in range(len(rows[0].cache.layers)):
            keys = [torch.nn.functional.pad(row.cache.layers[layer].keys, (0, 0, pad, 0))
                    for row, pad in zip(rows, self.pads)]
            values = [torch.nn.functional.pad(row.cache.layers[layer].values, (0, 0, pad, 0))
                      for row, pad in zip(rows, self.pads)]
            self.cache.update(torch.cat(keys), torch.cat(values), layer)
        self.mask = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
        for b, pad in enumerate(self.pads):
            self.mask[b, pad:] = 1

    def holds(self, rows: list[TalkerRow]) -> bool:
        """These rows, in this order, are the group's (none of them stepped apart since)."""
        return len(rows) == len(self.rows) and all(a is b and a.group is self for a, b in zip(rows, self.rows))

    def grow(self) -> torch.Tensor:
        """The attention mask of the next step (one more position for every row)."""
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)
        return self.mask


class FedTalkerStage(LoopStage):
    """A talker's loop that its thinker feeds (Qwen2.5-Omni's here, Qwen3-Omni's in pipelines/omni3.py): each
    spoken request's reply joins as a row when its feed's piece arrives and steps with the others. A step opens the
    rows whose feed allows it (their prompts prefilled alone), draws the next code of every row that has logits,
    and feeds in one forward the drawn codes whose next input is there (`talker.can_feed`); a row waiting on its
    thinker sits out, and when every row waits the loop waits on the feeds. Subclasses make the row (`start`) and
    the outputs (`finish`)."""

    kind = "talker"
    feed_class: type = ThinkerFeed

    def __init__(self, model: str, voice, talker):
        self.model = model
        self.voice = voice
        self.talker = talker
        self.wake = threading.Condition()  # the feeds': told of every change

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model

    def feed(self):
        """A request's streaming edge from its thinker (the splitter the graph makes per request)."""
        return self.feed_class(self.wake)

    def ready(self, item: WorkItem) -> bool:
        return self.talker.can_move(item.state["row"])

    def wait(self, items: list[WorkItem]) -> None:
        with self.wake:
            if not any(self.ready(item) for item in items):
                self.wake.wait(WAIT_S)

    @torch.inference_mode()
    def step(self, items: list[WorkItem]) -> None:
        talker = self.talker
        rows = [item.state["row"] for item in items]
        for row in rows:
            if row.cache is None and not row.finished and talker.can_open(row):
                talker.open(row)
        drawing = [row for row in rows if row.logits is not None and not row.finished]
        if drawing:
            talker.sample(drawing)
        feeding = [row for row in rows if talker.can_feed(row)]
        if feeding:
            talker.feed(feeding)

    def is_done(self, item: WorkItem) -> bool:
        return item.state["row"].finished

    def abort(self, item: WorkItem) -> None:
        item.state.pop("row", None)


class TalkerStage(FedTalkerStage):
    """Qwen2.5-Omni's talker loop: a row's codes go out as DELTAs {"codes"} for a streamed reply; its outputs are
    the codes and the generator's state after them (token2wav continues a whole reply's stream)."""

    def __init__(self, model: str, voice: OmniVoice, max_codes: int = 4096):
        super().__init__(model, voice, Talker(voice, max_codes))

    def start(self, item: WorkItem) -> None:
        speech: SpeechOutput = item.inputs["speech"]
        told = (lambda code: item.emit(EventKind.DELTA, codes=[code])) if speech.stream else None
        item.state["row"] = TalkerRow(item.inputs["thinker"], speech, told, self.voice.device)

    def finish(self, item: WorkItem) -> dict[str, Any]:
        row: TalkerRow = item.state.pop("row")
        return {"codes": row.codes, "rng": row.generator.get_state()}


def talked(inputs: dict[str, Any]) -> dict[str, Any]:
    """A whole reply's token2wav inputs: the talker node's codes and generator state (its one piece's outputs)."""
    pieces = inputs["pieces"]
    return {**inputs, **(pieces[0] if pieces else {"codes": [], "rng": 0})}

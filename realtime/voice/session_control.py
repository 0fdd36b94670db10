"""The control events of a voice session: `session.update` (its configuration, the beta dialect, the
transcription settings), `session.heartbeat`, `session.event_ack`, and `session.resume` sent too late.

A mixin of VoiceSession (realtime/voice/session.py), as turns.py is: it uses the session's state (config,
spec, limits, input, outbox) and owns none of its own. What an update may change is protocol.py's
`apply_session_update`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pipelines.asr_incremental import IncrementalTranscriber
from pipelines.image_request import RequestError
from realtime.voice.protocol import ProtocolError, SessionConfig, apply_session_update, is_beta_session, session_object

if TYPE_CHECKING:
    from realtime.voice.session import Inbound


class SessionControl:
    async def _session_update(self, event: dict, inbound: Inbound) -> None:
        session = event.get("session")
        beta = self.config.beta or (not self._updated and isinstance(session, dict) and is_beta_session(session))
        config = apply_session_update(self.config, session, model=self.spec.name, voices=self.voices,
                                      max_tokens_cap=self.spec.max_output_tokens, voice_locked=self._voice_used,
                                      tool_choices=self.tool_choices)
        if not self.spec.omni and (config.transcription_language, config.transcription_prompt) != \
                (self.config.transcription_language, self.config.transcription_prompt):
            try:
                self._transcriber(config)
            except RequestError as exc:
                raise ProtocolError(exc.code, f"transcription: {exc.message}",
                                    param=f"session.audio.input.transcription.{exc.param}") from None
        self.config, self._updated = _with_beta(config, beta), True
        self.disarm_idle()
        self.input.configure(config.input_format, config.turn_detection)
        await self.emit({"type": "session.updated", "session": self._session()})

    async def _heartbeat(self, event: dict, inbound: Inbound) -> None:
        await self.emit({"type": "session.heartbeat_ack", "server_event_seq_last": self.outbox.journal.last_seq})

    async def _event_ack(self, event: dict, inbound: Inbound) -> None:
        seq = event.get("server_event_seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ProtocolError("invalid_value", "server_event_seq must be an integer >= 0", param="server_event_seq")
        self.outbox.journal.ack(seq)

    async def _resume(self, event: dict, inbound: Inbound) -> None:
        raise ProtocolError("invalid_event", "session.resume must be the first event on a new connection",
                            param="type")

    def _session(self) -> dict[str, Any]:
        return session_object(self.config, session_id=self.id, model=self.spec.name)

    def _transcriber(self, config: SessionConfig | None = None) -> IncrementalTranscriber:
        """The ASR lane's transcriber for the session's transcription settings (or for an update's, to check them)."""
        c = config or self.config
        return IncrementalTranscriber(self.engine, self.spec.asr, language=c.transcription_language,
                                      prompt=c.transcription_prompt, partial_every_s=self.limits.partial_every_s)


def _with_beta(config: SessionConfig, beta: bool) -> SessionConfig:
    return config if config.beta == beta else replace(config, beta=beta)

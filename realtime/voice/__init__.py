"""Realtime voice sessions (OpenAI Realtime protocol): wire, input audio and turn detection,
conversation items, responses."""

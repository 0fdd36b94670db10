"""Realtime WebSocket sessions: voice (OpenAI Realtime protocol) and video (JSON control + binary frames).

Sessions are state machines over the Engine (pipelines/); serve/ only accepts the socket and pumps frames.
"""

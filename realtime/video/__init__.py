"""Realtime video sessions (`WS /v1/realtime/video`): wire, settings, flow control and the modes."""

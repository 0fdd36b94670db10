"""The HTTP and WebSocket routes, one module per API area: parse, submit, reply."""

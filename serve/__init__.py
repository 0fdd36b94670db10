"""The HTTP surface of mmserve: FastAPI app, OpenAI-compatible schemas, errors, config and the CLI."""

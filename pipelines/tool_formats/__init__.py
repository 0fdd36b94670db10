"""Tool-call formats of chat templates, one module per format: `detect(template)` says whether a chat template
speaks it, `parse(text, names)` reads a reply into (its content or None, [(function name, arguments)]). A call
naming no known function, or whose JSON does not parse, stays in the content."""

from __future__ import annotations

from types import ModuleType

from pipelines.tool_formats import hermes, llama3

FORMATS: tuple[ModuleType, ...] = (hermes, llama3)


def format_of(template: str | None) -> ModuleType | None:
    """The tool format a chat template speaks, or None (it renders no tools)."""
    if not template:
        return None
    return next((form for form in FORMATS if form.detect(template)), None)

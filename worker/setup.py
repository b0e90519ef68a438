"""Per-model choices made once at load: how tools are rendered and how output is parsed."""

from __future__ import annotations

from typing import Any

from .prompt import RenderOptions


def model_extras(tokenizer: Any, options: dict) -> dict[str, Any]:
    """Keyword arguments for GenerationService that depend on the loaded model."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"render_options": RenderOptions(template_takes_tools="tools" in template)}

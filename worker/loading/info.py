"""What a loader learned about a model besides its weights and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelInfo:
    """Facts the worker announces or needs to size requests.

    `context_window` is the model's trained maximum sequence length in tokens;
    `quantization` names the stored weight format (e.g. "gguf:Q4_1", "affine-4bit",
    "float16") for logs and the model listing.
    """

    architecture: str
    name: str | None
    context_window: int
    quantization: str
    extra: dict[str, object] = field(default_factory=dict)

"""Splitting generated text into reasoning (``<think>...</think>``) and content.

Only a reasoning block at the very start counts (that is where templates put
it); a ``<think>`` later in the reply is content. When the generation prompt
already opened the block (it ends in ``<think>\\n``), the model starts inside
it: ``start_in_reasoning=True``, so reasoning streams from the first token.

Whitespace is formatting here: whitespace before the opening tag, at both
ends of the reasoning and right after the closing tag is dropped. Tags split
across chunks are held back until they are certain, so any split of the same
text gives the same reasoning and content.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["reasoning", "content"]
Piece = tuple[Kind, str]


def prompt_opens_reasoning(rendered_prompt: str, open_tag: str = "<think>") -> bool:
    """Whether the rendered prompt ends inside an opened reasoning block."""
    return rendered_prompt.rstrip().endswith(open_tag)


def _held(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental reasoning/content splitter for one generation."""

    def __init__(
        self,
        start_in_reasoning: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._start_in_reasoning = start_in_reasoning
        self._state: Literal["start", "reasoning", "after", "content"] = "start"
        self._buf = ""
        self._reasoning_started = False
        self._reasoning_ws = ""  # trailing whitespace held inside the reasoning
        self._done = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning block."""
        return self._state == "reasoning" or (self._state == "start" and self._start_in_reasoning)

    def feed(self, text: str) -> list[Piece]:
        """Consume generated text; return the pieces it settles, in order."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._merge(self._run(final=False))

    def finish(self) -> list[Piece]:
        """Flush what was held back (a partial tag is text after all)."""
        if self._done:
            return []
        pieces = self._run(final=True)
        if self._state == "start" and self._buf.strip():  # only a partial open tag
            pieces += self._reasoning(self._buf) if self._start_in_reasoning else [("content", self._buf)]
        elif self._state == "reasoning":
            pieces += self._reasoning(self._buf)
        self._buf, self._done = "", True
        return self._merge(pieces)

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped or (self.open_tag.startswith(stripped) and not final):
                    return pieces
                if stripped.startswith(self.open_tag):
                    # (Also when the prompt opened the block: a repeated tag is dropped.)
                    self._state, self._buf = "reasoning", stripped[len(self.open_tag) :]
                elif self._start_in_reasoning:
                    self._state = "reasoning"
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                pos = self._buf.find(self.close_tag)
                if pos == -1:
                    cut = len(self._buf) - (0 if final else _held(self._buf, self.close_tag))
                    if final:
                        return pieces  # finish() flushes the rest
                    pieces += self._reasoning(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return pieces
                pieces += self._reasoning(self._buf[:pos])
                self._reasoning_ws = ""
                self._state, self._buf = "after", self._buf[pos + len(self.close_tag) :]
            elif self._state == "after":
                stripped = self._buf.lstrip()
                self._buf = stripped
                if not stripped:
                    return pieces
                self._state = "content"
            else:
                if self._buf:
                    pieces.append(("content", self._buf))
                self._buf = ""
                return pieces

    def _reasoning(self, text: str) -> list[Piece]:
        """Reasoning text with leading/trailing whitespace held or dropped."""
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return []
            self._reasoning_started = True
        combined = self._reasoning_ws + text
        body = combined.rstrip()
        self._reasoning_ws = combined[len(body) :]
        return [("reasoning", body)] if body else []

    @staticmethod
    def _merge(pieces: list[Piece]) -> list[Piece]:
        merged: list[Piece] = []
        for kind, text in pieces:
            if merged and merged[-1][0] == kind:
                merged[-1] = (kind, merged[-1][1] + text)
            elif text:
                merged.append((kind, text))
        return merged

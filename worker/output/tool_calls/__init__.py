"""Incremental tool-call parsing, one module per format; ``parser_for`` picks one."""

from .base import (
    ArgumentsDelta,
    CallStarted,
    FinalParse,
    ParsedCall,
    ParserEvent,
    TextDelta,
    ToolCallParser,
)
from .select import FORMATS, format_for_template, parser_for

__all__ = [
    "ArgumentsDelta",
    "CallStarted",
    "FinalParse",
    "FORMATS",
    "ParsedCall",
    "ParserEvent",
    "TextDelta",
    "ToolCallParser",
    "format_for_template",
    "parser_for",
]

"""LangChain's ChatOpenAI against Kiln (run by test_client_families_real_model.py with the pinned
install on PYTHONPATH): invoke, stream and a forced tool round trip on Chat Completions, the
class's default API. Prints one JSON object of what the user sees."""

from __future__ import annotations

import json
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

BASE_URL, MODEL = sys.argv[1], sys.argv[2]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny, 21 C in {city}."


common = {"model": MODEL, "base_url": BASE_URL, "api_key": "sk-local", "temperature": 0, "max_retries": 0, "timeout": 600}
llm = ChatOpenAI(max_tokens=16, **common)
plain = llm.invoke("Say hello.")
chunks = [c.content for c in llm.stream("Name a colour.")]

question = HumanMessage("What's the weather in Rome?")
# A call needs more room than an answer: a call the cap cuts comes back with finish_reason
# "length" and the arguments cut short, which LangChain reads as a call with no arguments.
forced = ChatOpenAI(max_tokens=48, **common).bind_tools([get_weather], tool_choice="get_weather")
call_message = forced.invoke([question])
call = call_message.tool_calls[0] if call_message.tool_calls else None
after = None
if call is not None:
    output = get_weather.invoke(call["args"])
    after = llm.invoke([question, call_message, ToolMessage(output, tool_call_id=call["id"])]).content
print(json.dumps({
    "text": plain.content,
    "stream": chunks,
    "tool": {"name": call["name"], "arguments": call["args"]} if call else None,
    "after_tool": after,
}))

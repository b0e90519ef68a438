"""OpenAI Agents SDK against Kiln (run by test_client_families_real_model.py with the pinned
install on PYTHONPATH): a plain run, a streamed run and a forced function tool round trip, all on
the Responses API (the SDK's default model class). Prints one JSON object of what the user sees."""

from __future__ import annotations

import asyncio
import json
import sys

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

BASE_URL, MODEL = sys.argv[1], sys.argv[2]


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny, 21 C in {city}."


async def main() -> None:
    set_tracing_disabled(True)  # tracing would post to api.openai.com
    client = AsyncOpenAI(base_url=BASE_URL, api_key="sk-local", max_retries=0, timeout=600)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    # The SDK raises on a reply the cap cut (response.incomplete), so the prompts ask for short
    # answers the model gives greedily well under the cap.
    settings = ModelSettings(max_tokens=32, temperature=0)
    agent = Agent(name="assistant", instructions="Answer in one short sentence.", model=model, model_settings=settings)

    plain = await Runner.run(agent, "What is 2+2? Answer with a number only.")

    streamed = Runner.run_streamed(agent, "Reply with the single word: yes")
    deltas = [e.data.delta async for e in streamed.stream_events() if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]

    # Forced on the first turn; the SDK resets tool_choice after the call (reset_tool_choice), so
    # the second turn answers from the tool output that went back to Kiln as function_call_output.
    tooled = agent.clone(tools=[get_weather], model_settings=ModelSettings(max_tokens=48, temperature=0, tool_choice="get_weather"))
    result = await Runner.run(tooled, "What's the weather in Rome?", max_turns=2)
    calls = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i.output for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    print(json.dumps({
        "text": plain.final_output,
        "stream": deltas,
        "stream_final": streamed.final_output,
        "tool": {"name": calls[0].name, "arguments": calls[0].arguments, "output": outputs[0]} if calls else None,
        "after_tool": result.final_output,
    }))


asyncio.run(main())

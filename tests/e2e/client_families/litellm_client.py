"""LiteLLM against Kiln (run by test_client_families_real_model.py with the pinned install on
PYTHONPATH): completion and a streamed completion through the ``openai/`` provider with api_base,
which speaks Chat Completions. Prints one JSON object of what the user sees."""

from __future__ import annotations

import json
import sys

import litellm

BASE_URL, MODEL = sys.argv[1], sys.argv[2]
common = {"model": f"openai/{MODEL}", "api_base": BASE_URL, "api_key": "sk-local", "max_tokens": 16, "temperature": 0, "timeout": 600}

plain = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **common)
stream = litellm.completion(messages=[{"role": "user", "content": "Name a colour."}], stream=True, **common)
chunks = [c.choices[0].delta.content for c in stream if c.choices]
print(json.dumps({"text": plain.choices[0].message.content, "finish": plain.choices[0].finish_reason, "stream": chunks}))

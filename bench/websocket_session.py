"""An agent-like session over HTTP (full history resent every turn) and over one WebSocket
(continuation through previous_response_id, store: false): bytes the client sent and median time
to first event of output per turn, against a real Kiln with the bundled model.

Each turn adds one tool call and its output, as an agent loop does. Run:
``.venv/bin/python -m bench.websocket_session [--turns 10] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets.sync.client

from tests.support import Kiln

MODEL = "smollm2-135m-instruct"
TOOL = {"type": "function", "name": "read_file", "description": "Read a file of the project.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
USAGE: dict[str, list] = {"http": [], "ws": []}
INSTRUCTIONS = "You are a coding agent. Read files with read_file, then answer briefly. " * 4


def tool_turn(i: int) -> list[dict]:
    """What an agent adds per turn: the model's tool call and the tool's output."""
    call_id = f"call_{i}"
    return [
        {"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": json.dumps({"path": f"src/module_{i}.py"})},
        {"type": "function_call_output", "call_id": call_id, "output": f"# module {i}\n" + "def f(x):\n    return x + 1\n" * 6},
    ]


def first_output_s(events, start: float) -> float | None:
    for event in events:
        if event.get("type") in ("response.output_text.delta", "response.function_call_arguments.delta", "response.output_item.added"):
            return time.monotonic() - start
    return None


def over_http(base: str, turns: int, max_tokens: int, session: str = "A") -> tuple[list[int], list[float]]:
    history: list[dict] = [{"role": "user", "content": "Look at the project and summarise it."}]
    sent, ttft = [], []
    with httpx.Client(base_url=base, timeout=600) as http:
        for i in range(turns):
            history += tool_turn(i)
            body = json.dumps({"model": MODEL, "instructions": f"Session {session}. " + INSTRUCTIONS, "input": history, "tools": [TOOL], "max_output_tokens": max_tokens, "temperature": 0,
                "stream": True, "store": False})
            sent.append(len(body.encode()))
            start = time.monotonic()
            first = None
            with http.stream("POST", "/v1/responses", content=body, headers={"content-type": "application/json"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if first is None:
                            first = first_output_s([event], start)
                        if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                            final = event["response"]
                            USAGE["http"].append((final["status"], final["usage"]))
            ttft.append(first or 0.0)
            history += [{k: v for k, v in item.items() if k != "status"} for item in final["output"]]  # an agent keeps all output
    return sent, ttft


def over_socket(base: str, turns: int, max_tokens: int, session: str = "B") -> tuple[list[int], list[float]]:
    sent, ttft = [], []
    previous = None
    with websockets.sync.client.connect(base.replace("http", "ws", 1) + "/v1/responses", max_size=None) as ws:
        for i in range(turns):
            new = ([{"role": "user", "content": "Look at the project and summarise it."}] if i == 0 else []) + tool_turn(i)
            body = {"type": "response.create", "model": MODEL, "instructions": f"Session {session}. " + INSTRUCTIONS, "input": new, "tools": [TOOL], "max_output_tokens": max_tokens,
                "temperature": 0, "store": False}
            if previous:
                body["previous_response_id"] = previous
            text = json.dumps(body)
            sent.append(len(text.encode()))
            start = time.monotonic()
            ws.send(text)
            first = None
            while True:
                event = json.loads(ws.recv())
                if first is None:
                    first = first_output_s([event], start)
                if event["type"] == "error":
                    raise SystemExit(f"turn {i}: {event}")
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    previous = event["response"]["id"]
                    USAGE["ws"].append((event["response"]["status"], event["response"]["usage"]))
                    break
            ttft.append(first or 0.0)
    return sent, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="5 turns, 8 output tokens")
    args = parser.parse_args()
    turns, max_tokens = (5, 8) if args.quick else (args.turns, 16)
    with tempfile.TemporaryDirectory() as tmp:
        server = Kiln(Path(tmp)).start()
        try:
            over_http(server.base_url, 1, 4, session="warm")  # load the model's kernels before timing
            # Different sessions (instructions) so that neither run is served from the other's cache.
            http_sent, http_ttft = over_http(server.base_url, turns, max_tokens)
            ws_sent, ws_ttft = over_socket(server.base_url, turns, max_tokens)
        finally:
            server.stop()
    print(f"{turns} turns, each adding a tool call and its output ({MODEL}, CPU)")
    print(f"{'':10}{'bytes sent':>12}{'median TTFT s':>15}{'last TTFT s':>13}")
    print(f"{'HTTP':10}{sum(http_sent):>12}{statistics.median(http_ttft):>15.3f}{http_ttft[-1]:>13.3f}")
    print(f"{'WebSocket':10}{sum(ws_sent):>12}{statistics.median(ws_ttft):>15.3f}{ws_ttft[-1]:>13.3f}")
    print("per turn bytes HTTP:", http_sent, file=sys.stderr)
    print("per turn bytes WS:  ", ws_sent, file=sys.stderr)
    print("per turn TTFT HTTP:", [round(t, 3) for t in http_ttft], file=sys.stderr)
    print("per turn TTFT WS:  ", [round(t, 3) for t in ws_ttft], file=sys.stderr)
    for kind in ("http", "ws"):
        for status, usage in USAGE[kind][-turns:]:
            print(kind, status, usage.get("input_tokens"), usage.get("input_tokens_details"), usage.get("output_tokens"), file=sys.stderr)


if __name__ == "__main__":
    main()

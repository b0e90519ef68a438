"""Deterministic prompts of a given length in SmolLM2 tokens.

Every peer gets byte-identical messages for the same run and request, so that prompts, chat
templates and token counts match. A short tag at the start of each user message (or system
prompt) makes each request's prompt unique, so a prefix cache helps only where the workload
means it to (a conversation's history, a shared system prompt), not across repeated runs.
"""

from __future__ import annotations

import functools

_FILLER = (
    "The old harbour town wakes slowly in winter. Fishing boats rock against the pier while gulls "
    "circle above the market square, where bakers open their shutters and the smell of fresh bread "
    "drifts down narrow streets paved with grey stone. Children walk to school along the sea wall, "
    "and the lighthouse on the northern cliff blinks its last beams before sunrise. "
)

_RULES = [
    "Answer in plain English and keep a friendly, professional tone.",
    "When the user asks for code, give complete, runnable examples with short comments.",
    "Prefer short paragraphs; use bullet lists only when they make an answer clearer.",
    "If a question is ambiguous, state the assumption you make before answering it.",
    "Never invent facts about the user's project; ask for the file or the error message instead.",
    "When you cite a command, show it on its own line so that it can be copied.",
    "Explain trade-offs when there is more than one reasonable way to do something.",
    "Keep answers about performance grounded in measurements rather than folklore.",
    "Use metric units and ISO dates unless the user writes otherwise.",
    "Mention security implications when an answer touches credentials, networks or permissions.",
]

QUESTIONS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "What should the keeper do with the message next? Describe it step by step.",
    "Now describe the town's reaction when the news spreads, in vivid detail.",
    "Continue the story: a storm arrives that night. What happens at the lighthouse?",
    "End the story with a surprising twist and explain why it fits the earlier events.",
    "Summarise the whole story in a few sentences for a children's book cover.",
]


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """SmolLM2's tokenizer (tokenizer.json of the converted folder), or None to estimate."""
    try:
        from tokenizers import Tokenizer

        from .convert import convert

        return Tokenizer.from_file(str(convert("q4") / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - fall back to an estimate; lengths are then approximate
        return None


def count_tokens(text: str) -> int:
    tok = _tokenizer()
    if tok is None:
        return max(1, len(text) // 4)
    return len(tok.encode(text, add_special_tokens=False).ids)


def fit(head: str, body: str, tail: str, n_tokens: int) -> str:
    """`head + body[:k] + tail` with k chosen so the whole is about `n_tokens` tokens."""
    budget_text = (body * (1 + (n_tokens * 6) // max(1, len(body))))
    words = budget_text.split(" ")
    lo, hi = 0, len(words)
    # Largest word count whose text fits in n_tokens (binary search: count_tokens is monotone enough).
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(head + " ".join(words[:mid]) + tail) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return head + " ".join(words[:lo]) + tail


def tag(kind: str, run: int, index: int) -> str:
    """A fixed-width unique tag: same token count for every (run, index)."""
    return f"[{kind}{run:02d}-{index:04d}] "


def user_prompt(run: int, index: int, n_tokens: int = 48, question: str = QUESTIONS[0]) -> str:
    """A user message of `n_tokens` tokens: tag, filler context, then the question."""
    return fit(tag("u", run, index), _FILLER, " " + question, n_tokens)


def system_prompt(run: int, n_tokens: int = 1000) -> str:
    """A long system prompt of about `n_tokens` tokens, unique to the run."""
    body = " ".join(_RULES) + " "
    return fit(tag("s", run, 0) + "You are a careful assistant for a software team. ", body, " Follow these rules in every answer.", n_tokens)


# An agent's edit turn: a source file in the prompt, and a request whose answer is that file again
# with one change, so most of the answer is copied from the prompt (where prompt lookup drafts).
_CODE_FUNCTIONS = [
    ("total_price", "items", "return sum(item.price * item.quantity for item in items)"),
    ("apply_discount", "total, percent", "if percent < 0 or percent > 100:\n        raise ValueError(\"percent must be between 0 and 100\")\n    return total * (100 - percent) / 100"),
    ("format_receipt", "items",
        "lines = [f\"{item.name:<20} {item.quantity:>3} x {item.price:>8.2f}\" for item in items]\n    lines.append(f\"{'total':<20} {total_price(items):>16.2f}\")\n    return \"\\n\".join(lines)"),
    ("find_item", "items, name", "for item in items:\n        if item.name == name:\n            return item\n    return None"),
    ("restock", "items, name, count", "item = find_item(items, name)\n    if item is None:\n        raise KeyError(name)\n    item.quantity += count\n    return item.quantity"),
    ("cheapest", "items", "if not items:\n        return None\n    return min(items, key=lambda item: item.price)"),
    ("group_by_category", "items", "groups = {}\n    for item in items:\n        groups.setdefault(item.category, []).append(item)\n    return groups"),
    ("load_items", "path", "with open(path, encoding=\"utf-8\") as f:\n        rows = json.load(f)\n    return [Item(**row) for row in rows]"),
    ("save_items", "items, path", "with open(path, \"w\", encoding=\"utf-8\") as f:\n        json.dump([item.__dict__ for item in items], f, indent=2)"),
    ("low_stock", "items, threshold=5", "return [item for item in items if item.quantity < threshold]"),
    ("price_range", "items", "prices = [item.price for item in items]\n    return (min(prices), max(prices)) if prices else (0.0, 0.0)"),
    ("rename_item", "items, old, new", "item = find_item(items, old)\n    if item is None:\n        raise KeyError(old)\n    item.name = new\n    return item"),
]

EDIT_REQUEST = "Rewrite this file with one change: rename the function `total_price` to `order_total` everywhere. Reply with the complete file and nothing else."


def code_file(run: int, index: int, n_tokens: int = 600) -> str:
    """A Python module of about `n_tokens` tokens (whole functions), unique per (run, index)."""
    head = (f"# inventory.py {tag('c', run, index)}\nimport json\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Item:\n"
            "    name: str\n    category: str\n    price: float\n    quantity: int\n")
    text = head
    for name, args, body in _CODE_FUNCTIONS:
        more = text + f"\n\ndef {name}({args}):\n    {body}\n"
        if count_tokens(more) > n_tokens:
            break
        text = more
    return text


def edit_prompt(run: int, index: int, n_tokens: int = 600) -> str:
    return f"{EDIT_REQUEST}\n\n```python\n{code_file(run, index, n_tokens)}```"

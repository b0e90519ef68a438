"""OpenAI's cursor pagination of item lists (``order``, ``limit``, ``after``), one implementation
for every list the gateway serves (a response's input items, a conversation's items)."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import QueryParams

from ..errors import invalid


def item_page(items: list[dict[str, Any]], params: QueryParams, *, unknown_after: str) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as a list object; ``unknown_after`` is the refusal's
    wording for an ``after`` id that is not in the list, e.g. ``"no input item {id!r}"``."""
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(params.get("limit", "20"))
    except ValueError:
        raise invalid("Invalid 'limit': expected an integer.", param="limit") from None
    if not 1 <= limit <= 100:
        raise invalid("Invalid 'limit': expected 1 to 100.", param="limit")
    ordered = list(reversed(items)) if order == "desc" else list(items)
    after = params.get("after")
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise invalid(f"Invalid 'after': {unknown_after.format(id=after)}.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return item_list(page, has_more=len(ordered) > limit)


def item_list(page: list[dict[str, Any]], *, has_more: bool = False) -> dict[str, Any]:
    """The list object; an empty page's ``first_id`` and ``last_id`` are "" (OpenAI's schema has
    them as required strings, so null fails a strict client)."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id", "") if page else "",
        "last_id": page[-1].get("id", "") if page else "",
        "has_more": has_more,
    }

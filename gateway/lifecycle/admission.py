"""Admission for every front door, in one function: the hosted checks when accounts are on
(``accounts/admission.py``), and in both modes the wait for an on-demand model to load
(``ondemand.py``).

A route calls ``admit`` once it has parsed the body and before any worker is involved, and hands
the ticket to the response lifecycle, which settles it. Routes never meter; the ticket is the hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Protocol

from starlette.requests import HTTPConnection

from kiln.protocol.usage import Usage

from ..accounts.middleware import GENERATION_SCOPE_KEY, PRINCIPAL_SCOPE_KEY, SLOT_SCOPE_KEY, accounts_unavailable
from ..doors.create_request import CreateRequest
from ..http.errors import ApiError


class Ticket(Protocol):
    """What admission hands the lifecycle: settle the bill once, close on every exit."""

    async def settle(self, status: str, usage: Usage | Mapping[str, Any] | None = None) -> Decimal | None:
        """Record the outcome (ledger status) and the usage the client received; the USD debited."""

    async def close(self) -> None:
        """Release what admission took; an unsettled ticket is recorded as an error."""

    async def cover(self, request: CreateRequest, window: int) -> None:
        """Extend the reservation to the expanded ``request`` before any work (402 when it cannot)."""


class OpenTicket:
    """Local mode: nothing is reserved, held or billed."""

    async def settle(self, status: str, usage: Usage | Mapping[str, Any] | None = None) -> Decimal | None:
        return None

    async def close(self) -> None:
        return None

    async def cover(self, request: CreateRequest, window: int) -> None:
        return None


async def admit(request: HTTPConnection, body: Mapping[str, Any], *, reserve: bool = True, turn: bool = False) -> Ticket:
    """Admit one request of an authenticated caller; raises the contract's ApiError.

    ``reserve`` is False for work that is checked (key scope, credits, concurrency) but not billed,
    such as counting input tokens. ``turn``: one turn of a WebSocket connection, admitted as an
    HTTP request of its own would be: it takes the organization's concurrency slot here (the
    middleware takes an HTTP request's) and gets a generation id of its own; the slot is freed
    when the turn settles, not held while the socket idles."""
    accounts = request.app.state.accounts
    loader = request.app.state.loader
    if accounts is None:
        await loader.ensure(body.get("model"))
        return OpenTicket()
    from ..accounts.admission import admit as hosted_admit
    from ..accounts.metering import new_generation_id

    principal = request.scope[PRINCIPAL_SCOPE_KEY]
    slot = None
    try:
        if turn:
            slot = await accounts.limiter.acquire(principal.org_id, principal.concurrency_limit)
        return await hosted_admit(
            accounts,
            principal=principal,
            generation_id=new_generation_id() if turn else request.scope.get(GENERATION_SCOPE_KEY) or "",
            body=body,
            pool=request.app.state.pool,
            reserve=reserve,
            slot=slot if turn else request.scope.get(SLOT_SCOPE_KEY),
            loader=loader,
        )
    except BaseException as exc:
        if slot is not None:
            await slot.release()
        if isinstance(exc, Exception) and not isinstance(exc, ApiError):  # the accounts database or Redis is down
            raise accounts_unavailable(exc) from None
        raise

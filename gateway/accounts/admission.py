"""Hosted admission: the checks a metered request passes before a worker is involved, and the
ticket that settles its bill however it ends.

The accounts middleware has authenticated the key by then (401); ``admit`` does the rest, in the
contract's order (docs/hosted.md): 400 ``background``, 404 ``model_not_found`` (catalog), 403
``model_not_allowed`` (key scope), 402 (no credit left, before an on-demand model is loaded), 503
(no worker serves the model), 402 (credits, read live: the reservation is a conditional debit in
the database, so a balance that just reached zero refuses the next request at once). The organization's concurrency slot (429) was taken by the middleware, before the body.

The ticket is the one hook through which a request's outcome reaches the ledger: the response
lifecycle calls ``settle(status, usage)`` exactly once with what the client received (before the
final bytes leave), and ``close()`` on every exit, which records a request that ended without a
settlement (an error) at cost 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import anyio

from kiln.gateway.doors.create_request import CreateRequest
from kiln.gateway.http.errors import ApiError
from kiln.protocol.usage import Usage

from .auth import Principal
from .limits import Slot
from .metering import UsageEvent, UsageRecord
from .service import Accounts

log = logging.getLogger("kiln.gateway.accounts")


class HostedTicket:
    """One admitted request: its reservation, its concurrency slot and its ledger row."""

    def __init__(self, accounts: Accounts, generation_id: str, principal: Principal, model: str, reserved_nanos: int, slot: Slot | None = None) -> None:
        self.accounts = accounts
        self.generation_id = generation_id
        self.principal = principal
        self.model = model
        self.reserved_nanos = reserved_nanos
        self.slot = slot  # held by the middleware until the answer ends; freed here at settlement
        self.started_at = time.monotonic()
        self.event: UsageEvent | None = None
        self._settled = False

    async def settle(self, status: str, usage: Usage | Mapping[str, Any] | None = None) -> Decimal | None:
        """Write the final ledger row (once); the USD debited, or None when it could not be written.

        Shielded from cancellation: a client that leaves while the row is written does not stop the
        write (the request's task is cancelled, not the ledger)."""
        if self._settled:
            return self.event.cost_usd if self.event is not None else None
        self._settled = True
        counts = usage if isinstance(usage, Usage) else Usage.from_map(usage)
        record = UsageRecord(
            generation_id=self.generation_id,
            org_id=self.principal.org_id,
            key_prefix=self.principal.key_prefix,
            model=self.model,
            status=status,
            input_tokens=counts.input_tokens,
            cached_tokens=counts.cached_tokens,
            output_tokens=counts.output_tokens,
            latency_ms=int((time.monotonic() - self.started_at) * 1000),
        )
        with anyio.CancelScope(shield=True):
            if self.slot is not None:
                await self.slot.release()  # the work is over: the organization may start the next
            try:
                self.event = await self.accounts.settle(record, self.reserved_nanos)
            except Exception:
                log.exception("usage event not recorded", extra={"generation_id": self.generation_id})
                return None
        return self.event.cost_usd if self.event is not None else None

    async def cover(self, request: CreateRequest, window: int) -> None:
        """Extend the reservation to ``request`` as it will be sent (history, conversation, socket
        state and item references expanded), before any work: admission only saw the request's
        own body, and a short body continuing a long transcript costs the transcript. 402 when
        the balance before this request's reservation is not above zero (Meter.top_up)."""
        if self._settled:  # a token count's ticket: nothing reserved, nothing to extend
            return
        inp, out = _reservation_tokens(request.to_json(), window)
        assert self.accounts.meter is not None
        extra = self.accounts.meter.price_nanos(self.model, inp, out) - self.reserved_nanos
        if extra <= 0:
            return
        if not await self.accounts.top_up(self.generation_id, self.principal.org_id, extra, self.reserved_nanos):
            raise _no_credits()
        self.reserved_nanos += extra

    async def close(self) -> None:
        """A request that ended without a settlement is recorded as an error (unbilled)."""
        if not self._settled:
            await self.settle("error")


def _reservation_tokens(body: Mapping[str, Any], window: int) -> tuple[int, int]:
    """The worst case a request can cost, in (input, output) tokens: its input cannot exceed the
    context window (nor, with a byte-level vocabulary, its own size in bytes plus the template), and
    its output is capped by ``max_output_tokens`` and the window."""
    from kiln.gateway.store.lru import approx_bytes

    window = window if window > 0 else 1 << 20
    inp = min(window, approx_bytes(body.get("input")) + approx_bytes(body.get("instructions")) + approx_bytes(body.get("tools")) + 1024)
    requested = body.get("max_output_tokens")
    out = requested if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0 else window
    return inp, min(out, window)


async def admit(accounts: Accounts, *, principal: Principal, generation_id: str, body: Mapping[str, Any], pool: Any, reserve: bool = True, slot: Slot | None = None,
    loader: Any = None) -> HostedTicket:
    """Admit a metered request (raises the contract's ApiError) and reserve its worst-case cost.

    ``reserve=False`` (token counting) checks the balance without reserving and writes no row.
    ``loader`` (gateway/pool/ondemand.py) loads an on-demand model once the key may use it."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "Missing required parameter: 'model'.", code="missing_required_parameter", param="model")
    if body.get("background") not in (None, False):
        # A background job outlives this HTTP exchange: the hosted contract has none.
        raise ApiError(400, "'background' is not supported on this gateway: send the request in the foreground.", code="unsupported_parameter", param="background")
    if accounts.catalog is not None:
        accounts.catalog.require(model)  # 404 model_not_found
    assert accounts.meter is not None
    if principal.allowed_models is not None and model not in principal.allowed_models:
        raise ApiError(403, f"This API key is not allowed to use the model '{model}'.", code="model_not_allowed", param="model")
    # 402 before any work on the request's behalf: an organization without credit must not make
    # the server load an on-demand model (or learn that none is loaded). The reservation below
    # checks again, atomically.
    if await accounts.meter.balance_nanos(principal.org_id) <= 0:
        raise _no_credits()
    if loader is not None:
        await loader.ensure(model)
    if accounts.catalog is not None:
        # A catalog model without a live worker is the backend's absence, not the client's error.
        served = pool.resolve(model)
        if served is None:
            raise ApiError(503, f"No model backend is serving '{model}' right now. Retry with exponential backoff.", headers={"Retry-After": "1"})
    else:
        served = pool.require(model)  # no catalog: 404 for a name no worker ever served
    reserved = 0
    if reserve:
        window = (pool.context_window(served) if pool is not None else 0) or 0
        inp, out = _reservation_tokens(body, window)
        price = accounts.meter.price_nanos(model, inp, out)
        record = UsageRecord(generation_id, principal.org_id, principal.key_prefix, model, "pending")
        if not await accounts.reserve(record, price):
            raise _no_credits()
        reserved = price
    elif await accounts.meter.balance_nanos(principal.org_id) <= 0:
        raise _no_credits()
    ticket = HostedTicket(accounts, generation_id, principal, model, reserved, slot)
    if not reserve:
        ticket._settled = True  # nothing to write: counting tokens is not billed
    return ticket


def _no_credits() -> ApiError:
    return ApiError(402, "Your organization has no credits left. Add credits to continue.", code="insufficient_quota")


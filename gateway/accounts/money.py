"""Money as integers.

Credits and costs are stored as whole **nano-dollars** (1e-9 USD) in BIGINT columns. Floats drift
and SQLite has no exact decimal type; micro-dollars are too coarse for one short request (the hosted
contract's own example costs 0.000001155 USD). A BIGINT of nano-dollars still holds balances up to
about 9.2 billion USD.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

NANOS_PER_USD = 10**9


def to_decimal(amount: Decimal | int | str | float) -> Decimal:
    """Read a USD amount without float artefacts (a float goes through its shortest repr)."""
    if isinstance(amount, Decimal):
        return amount
    if isinstance(amount, float):
        return Decimal(repr(amount))
    return Decimal(amount)


def usd_to_nanos(amount: Decimal | int | str | float) -> int:
    """USD -> whole nano-dollars, rounding half up (the one rounding step of the billing path)."""
    value = to_decimal(amount)
    if not value.is_finite():
        raise ValueError(f"not a finite amount: {amount!r}")
    return int((value * NANOS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def nanos_to_usd(nanos: int) -> Decimal:
    """Whole nano-dollars -> an exact USD Decimal."""
    return Decimal(int(nanos)).scaleb(-9).normalize() if nanos else Decimal(0)

"""The model catalog: which model ids the gateway serves and what their tokens cost.

A TOML file, one table per model, prices in USD per million tokens::

    [models."qwen3-32b"]
    input = "0.10"          # also plain TOML numbers: 0.10
    cached_input = "0.05"   # optional; defaults to the input price
    output = "0.30"

Numbers are parsed as Decimal (never float) so that prices and costs are exact. Unknown keys are
refused, so a typo such as ``cached = ...`` cannot silently bill at the wrong rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kiln.gateway.http.errors import ApiError

_MILLION = Decimal(1_000_000)
_PRICE_KEYS = {"input", "cached_input", "output"}


class CatalogError(ValueError):
    """The catalog file is malformed; the message names the model and field."""


@dataclass(frozen=True)
class ModelPrice:
    model: str
    input_per_million: Decimal
    cached_input_per_million: Decimal
    output_per_million: Decimal


def _price(model: str, field: str, value: object) -> Decimal:
    if isinstance(value, bool):
        raise CatalogError(f"model {model!r}: {field} must be a number of USD per million tokens")
    try:
        price = Decimal(value) if isinstance(value, (int, str, Decimal)) else None
    except InvalidOperation:
        price = None
    if price is None or not price.is_finite() or price < 0:
        raise CatalogError(f"model {model!r}: {field} must be a non-negative USD amount, got {value!r}")
    return price


class Catalog:
    """Served model ids and their prices."""

    def __init__(self, prices: dict[str, ModelPrice]) -> None:
        self._prices = dict(prices)

    @classmethod
    def load(cls, path: str | Path) -> Catalog:
        with open(path, "rb") as fp:
            return cls.from_dict(tomllib.load(fp, parse_float=Decimal))

    @classmethod
    def loads(cls, text: str) -> Catalog:
        return cls.from_dict(tomllib.loads(text, parse_float=Decimal))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Catalog:
        models = data.get("models")
        if not isinstance(models, dict):
            raise CatalogError("the catalog needs a [models.\"<id>\"] table per served model")
        prices: dict[str, ModelPrice] = {}
        for model, entry in models.items():
            if not isinstance(entry, dict):
                raise CatalogError(f"model {model!r}: expected a table of prices")
            unknown = set(entry) - _PRICE_KEYS
            if unknown:
                raise CatalogError(f"model {model!r}: unknown keys {sorted(unknown)}")
            for required in ("input", "output"):
                if required not in entry:
                    raise CatalogError(f"model {model!r}: missing {required}")
            input_price = _price(model, "input", entry["input"])
            prices[model] = ModelPrice(
                model=model,
                input_per_million=input_price,
                cached_input_per_million=_price(
                    model, "cached_input", entry.get("cached_input", input_price)
                ),
                output_per_million=_price(model, "output", entry["output"]),
            )
        return cls(prices)

    def models(self) -> list[str]:
        return sorted(self._prices)

    def __contains__(self, model: object) -> bool:
        return model in self._prices

    def get(self, model: str) -> ModelPrice | None:
        return self._prices.get(model)

    def require(self, model: str) -> ModelPrice:
        """The model's price, or the contract's 404 ``model_not_found``."""
        price = self._prices.get(model)
        if price is None:
            raise ApiError(404, f"The model '{model}' does not exist or you do not have access to it.", code="model_not_found", param="model")
        return price

    def cost(self, model: str, input_tokens: int, cached_tokens: int, output_tokens: int) -> Decimal:
        """Exact USD cost: cached input at the cached rate, the rest of the input at the input rate.

        ``cached_tokens`` is part of ``input_tokens`` (as in Responses usage) and is clamped to it.
        """
        price = self.require(model)
        if min(input_tokens, cached_tokens, output_tokens) < 0:
            raise ValueError("token counts must not be negative")
        cached = min(cached_tokens, input_tokens)
        total = (input_tokens - cached) * price.input_per_million + cached * price.cached_input_per_million + output_tokens * price.output_per_million
        return total / _MILLION

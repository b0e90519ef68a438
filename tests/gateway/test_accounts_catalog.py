"""The model catalog: exact prices from TOML, cached-input pricing, refusals of bad files."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from kiln.gateway.accounts.catalog import Catalog, CatalogError
from kiln.gateway.accounts.money import nanos_to_usd, usd_to_nanos
from kiln.gateway.http.errors import ApiError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "catalog.example.toml"


def test_example_catalog_loads_with_exact_prices():
    catalog = Catalog.load(EXAMPLE)
    price = catalog.get("qwen3-32b")
    assert price is not None and price.input_per_million == Decimal("0.10")
    small = catalog.get("smollm2-135m-instruct")
    assert small is not None and small.input_per_million == Decimal("0.01")  # TOML float, no drift
    assert catalog.get("nope") is None
    assert "qwen3-32b" in catalog.models()


def test_cost_prices_cached_tokens_at_the_cached_rate():
    catalog = Catalog.loads('[models.m]\ninput = 3\ncached_input = "0.3"\noutput = 15\n')
    # 1000 input of which 800 cached: 200*3 + 800*0.3 + 50*15 = 600 + 240 + 750 = 1590 per 1e6
    assert catalog.cost("m", 1000, 800, 50) == Decimal("0.00159")
    assert catalog.cost("m", 10, 99, 0) == Decimal("0.000003")  # cached clamped to input
    assert catalog.cost("m", 0, 0, 0) == 0


def test_cached_price_defaults_to_input_and_unknown_model_is_404():
    catalog = Catalog.loads('[models.m]\ninput = 0.1\noutput = 0.2\n')
    assert catalog.get("m").cached_input_per_million == Decimal("0.1")
    with pytest.raises(ApiError) as err:
        catalog.require("other")
    assert err.value.status == 404 and err.value.code == "model_not_found"


@pytest.mark.parametrize(
    "text",
    [
        "",
        '[models.m]\ninput = 1\n',
        '[models.m]\ninput = 1\noutput = 1\ncached = 1\n',
        '[models.m]\ninput = -1\noutput = 1\n',
        '[models.m]\ninput = "abc"\noutput = 1\n',
        '[models.m]\ninput = true\noutput = 1\n',
    ],
)
def test_malformed_catalogs_are_refused(text):
    with pytest.raises(CatalogError):
        Catalog.loads(text)


def test_money_round_trips_in_nano_dollars():
    assert usd_to_nanos("0.000001155") == 1155
    assert usd_to_nanos(0.1) == 100_000_000
    assert usd_to_nanos(Decimal("0.0000000005")) == 1  # half up
    assert nanos_to_usd(1155) == Decimal("0.000001155")
    assert nanos_to_usd(0) == 0

"""The web pages' shared fixture: one headless browser per module (browser.py says which)."""

from __future__ import annotations

import pytest

from .browser import chrome


@pytest.fixture(scope="module")
def browser():
    """Started before any server a test asks for after it, so a machine without a browser skips
    before it loads a model."""
    driver = chrome()
    yield driver
    driver.quit()

"""A real headless browser for the web pages' tests: Debian's ``chromium`` driven through
``chromedriver`` by Selenium (``./dev test`` installs both where apt is there and we are root).
Where either is missing the tests skip, saying what to install.

Screenshots go to ``build/screenshots/`` (gitignored), printed at the end of each test that takes
one, so a person can look at what the test saw.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(os.environ.get("KILN_SCREENSHOTS", REPO / "build" / "screenshots"))
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
PHONE = (390, 844)
DESKTOP = (1280, 1000)


def _find(names: tuple[str, ...]) -> str | None:
    for name in names:
        found = shutil.which(name) or (f"/usr/lib/chromium/{name}" if Path(f"/usr/lib/chromium/{name}").exists() else None)
        if found:
            return found
    return None


def chrome(size: tuple[int, int] = DESKTOP):
    """A new headless Chromium (the caller quits it), or a skip that says what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[test]'")
    binary, driver = _find(BROWSERS), _find(DRIVERS)
    if binary is None or driver is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver (./dev test does it as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={size[0]},{size[1]}", "--lang=en-US", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def screenshot(driver, name: str) -> Path:
    """Save the whole page, beyond the window, as ``build/screenshots/<name>.png``; its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {path}")
    return path


def console_errors(driver) -> list[str]:
    """The page's severe console messages (a CSP violation or a script error shows here)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(driver, condition: Callable, timeout: float = 120, message: str = ""):
    """Wait, bounded, for ``condition(driver)`` to be truthy; its value."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # A table the page re-renders replaces the element found a moment ago: look again.
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)).until(condition, message)


def by_testid(driver, testid: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f"[data-testid='{testid}']")


def all_by_testid(driver, testid: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, f"[data-testid='{testid}']")


def too_wide(driver) -> list[str]:
    """What sticks out past the window's right edge, outside any scrolling box (empty: it fits)."""
    return driver.execute_script(
        "const w = document.documentElement.clientWidth; const out = [];"
        "const clipped = (e) => { for (let p = e.parentElement; p && p !== document.body; p = p.parentElement)"
        " { if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(p).overflowX)) return true; } return false; };"
        "if (document.documentElement.scrollWidth > w) out.push(`page scrollWidth=${document.documentElement.scrollWidth} > ${w}`);"
        "for (const e of document.querySelectorAll('body *')) { const r = e.getBoundingClientRect();"
        " if (r.width && r.right > w + 1 && !clipped(e)) out.push(`${e.tagName.toLowerCase()}#${e.id}.${e.className} right=${Math.round(r.right)}`); }"
        "return out.slice(0, 12);"
    )

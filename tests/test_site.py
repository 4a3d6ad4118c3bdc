"""The built docs site works in a real browser, offline.

The site is built into a temporary folder, served on 127.0.0.1 and opened in
headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by
selenium). Every page must load without a console error, from this server
only, with every image decoded; the search must find a word; light and dark
mode must both be readable; a stage page's solutions must be folded (closed
<details>) when it loads. Screenshots of the home page and the stage 1 page go
to $SITE_SCREENSHOTS (default build/screenshots/).

Without /usr/bin/chromium the module is skipped, except under CI (the CI
variable set), where a missing browser is a failure: .ci/run installs it.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = Path(os.environ.get("SITE_SCREENSHOTS") or ROOT / "build" / "screenshots")
SEARCH_WORD = "softmax"
MIN_CONTRAST = 4.5  # WCAG AA for body text


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (apt-get install chromium chromium-driver)"
    if not CHROMEDRIVER.exists():
        return f"{CHROMEDRIVER} not found (apt-get install chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e .[dev])"
    return None


MISSING = _missing()
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
if MISSING and not IN_CI:
    pytest.skip(f"browser tests need Chromium: {MISSING}", allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if MISSING:
        pytest.fail(f"CI is set, so the browser tests must run, but {MISSING}")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def base_url(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _pages(site: Path) -> list[str]:
    """Every page of the built site, as a path relative to the site root ('' is the home page)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        pages.append("" if rel == "." else rel + "/")
    return pages


def _open(browser, url: str) -> None:
    browser.get(url)
    deadline = time.monotonic() + 30
    while browser.execute_script("return document.readyState") != "complete":
        assert time.monotonic() < deadline, f"{url} did not finish loading"
        time.sleep(0.05)


def _severe(browser) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


BROKEN_IMAGES_JS = """
return Array.from(document.images)
    .filter(img => !img.complete || img.naturalWidth === 0)
    .map(img => img.getAttribute('src'));
"""

FOREIGN_RESOURCES_JS = """
return performance.getEntriesByType('resource').map(r => r.name)
    .filter(name => !name.startsWith(location.origin + '/') && !name.startsWith('data:')
                    && !name.startsWith('blob:'));
"""


def test_every_page_loads_cleanly(site, base_url, browser):
    pages = _pages(site)
    assert "" in pages and "stages/01-single-tile/" in pages, pages
    _severe(browser)  # drop anything logged before the first page
    problems = []
    for page in pages:
        _open(browser, base_url + page)
        errors = _severe(browser)
        broken = browser.execute_script(BROKEN_IMAGES_JS)
        foreign = browser.execute_script(FOREIGN_RESOURCES_JS)
        if errors:
            problems.append(f"/{page}: console errors: {errors}")
        if broken:
            problems.append(f"/{page}: images that did not load (naturalWidth 0): {broken}")
        if foreign:
            problems.append(f"/{page}: loads resources from outside the site (it must work offline): {foreign}")
    assert not problems, f"{len(problems)} problem(s) in {len(pages)} pages:\n" + "\n".join(problems)


def test_notebook_downloads(site, base_url, browser):
    _open(browser, base_url + "notebooks/")
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('a[download]')).map(a => a.href)")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(links) == len(notebooks) > 0, f"the notebooks page should offer {len(notebooks)} downloads: {links}"
    for link in links:
        with urllib.request.urlopen(link) as response:
            nb = json.loads(response.read())
        assert nb.get("cells"), f"{link} is not a notebook"


def test_search_finds_a_word(base_url, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, base_url)
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    if not box.is_displayed():  # narrow window: the search box hides behind a header button
        browser.find_element(By.CSS_SELECTOR, "label.md-header__button[for='__search']").click()
    box = WebDriverWait(browser, 10).until(EC.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()
    box.send_keys(SEARCH_WORD)
    WebDriverWait(browser, 20).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, ".md-search-result__item"),
        message=f"typing {SEARCH_WORD!r} in the search box showed no results",
    )
    items = browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
    assert any(SEARCH_WORD in item.text.lower() for item in items), [item.text[:80] for item in items]
    assert not _severe(browser)


def _luminance(rgb: tuple[float, float, float]) -> float:
    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(fg, bg) -> float:
    hi, lo = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


COLORS_JS = """
const parse = c => { const v = c.match(/[\\d.]+/g).map(Number); return v.slice(0, 4); };
const text = document.querySelector('.md-content .md-typeset p');
return {
    scheme: document.body.getAttribute('data-md-color-scheme'),
    background: parse(getComputedStyle(document.body).backgroundColor),
    text: parse(getComputedStyle(text).color),
};
"""


def _colors(browser) -> dict:
    colors = browser.execute_script(COLORS_JS)
    background = colors["background"]
    assert len(background) == 3 or background[3] == 1, f"the page background is transparent: {colors}"
    fg = colors["text"]
    if len(fg) == 4:  # text with alpha: blend it over the background as the browser does
        alpha = fg[3]
        fg = [alpha * f + (1 - alpha) * b for f, b in zip(fg[:3], background[:3])]
    colors["contrast"] = _contrast(fg[:3], background[:3])
    return colors


def _toggle_palette(browser) -> None:
    from selenium.webdriver.common.by import By

    before = browser.execute_script("return document.body.getAttribute('data-md-color-scheme')")
    toggles = [t for t in browser.find_elements(By.CSS_SELECTOR, "form[data-md-component='palette'] label")
               if t.is_displayed()]
    assert toggles, "no visible light/dark toggle in the header"
    toggles[0].click()
    deadline = time.monotonic() + 5
    while browser.execute_script("return document.body.getAttribute('data-md-color-scheme')") == before:
        assert time.monotonic() < deadline, "clicking the palette toggle did not change the color scheme"
        time.sleep(0.05)
    time.sleep(0.5)  # let any color transition finish


def test_light_and_dark_mode_are_readable(base_url, browser):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    _open(browser, base_url)
    light = _colors(browser)
    if light["scheme"] != "default":
        _toggle_palette(browser)
        light = _colors(browser)
    _toggle_palette(browser)
    dark = _colors(browser)
    browser.save_screenshot(str(SCREENSHOTS / "home-dark.png"))
    _toggle_palette(browser)  # back to light for the other tests
    assert (light["scheme"], dark["scheme"]) == ("default", "slate"), (light, dark)
    assert light["background"][:3] != dark["background"][:3], f"dark mode has the light background: {dark}"
    for mode in (light, dark):
        assert mode["contrast"] >= MIN_CONTRAST, f"body text contrast {mode['contrast']:.2f} < {MIN_CONTRAST}: {mode}"


@pytest.mark.parametrize("page, name", [("", "home.png"), ("stages/01-single-tile/", "stage-01.png")])
def test_screenshots(base_url, browser, page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    _open(browser, base_url + page)
    assert browser.execute_script("return document.body.getAttribute('data-md-color-scheme')") == "default"
    path = SCREENSHOTS / name
    assert browser.save_screenshot(str(path)), f"could not write {path}"
    assert path.stat().st_size > 10_000, f"{path} looks empty"


SOLUTIONS_JS = """
return Array.from(document.querySelectorAll('.md-content details.success')).map(d => ({
    title: (d.querySelector('summary') || {}).textContent || '',
    open: d.open || d.hasAttribute('open'),
    // A closed <details> keeps its content laid out but hidden (content-visibility), so ask
    // the browser whether the code is visible rather than measuring it.
    code_visible: Array.from(d.querySelectorAll('pre')).some(pre => pre.checkVisibility()),
}));
"""


def test_stage_solutions_are_folded_on_load(base_url, browser):
    """On a stage page the solutions exist, as <details> that are closed (not `open`) when the page loads."""
    _open(browser, base_url + "stages/03-online-softmax/")
    solutions = browser.execute_script(SOLUTIONS_JS)
    titles = [s["title"].strip() for s in solutions]
    assert len(solutions) >= 2 and any("online_softmax" in t for t in titles), (
        f"stage 3's page should have a folded solution for each exercise function; found {titles}")
    opened = [s["title"].strip() for s in solutions if s["open"] or s["code_visible"]]
    assert not opened, f"these solutions are open (their code visible) on load; use `??? success`, not `???+`: {opened}"

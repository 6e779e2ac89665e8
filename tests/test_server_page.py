"""The chat page at `/` in a real headless browser (Debian's chromium + chromedriver through
Selenium) against a real `dsv4 serve`: the answer streams in token by token, a second
answer is stopped midway (and the server stops generating), the live panel updates, the
conversation survives a reload, model text cannot inject HTML, thinking is folded, copy
works, a long prefill shows its progress by layer; a screenshot is saved
(to $DSV4_SCREENSHOT when set, else into the test's temporary directory)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from server_proc import Server

from dsv4stream.checkpoint import synth

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="no chromium/chromedriver here: `apt-get install chromium chromium-driver` (make test does it where it can)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ck = synth.make_checkpoint(
        tmp_path_factory.mktemp("page") / "tiny", preset="tiny", seed=9, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )
    # small segments: a long prefill lasts long enough for the page's polls to see its layers
    with Server(ck, "--ctx", "4096", "--prefill-segment", "16") as s:
        yield s


@pytest.fixture(scope="module")
def driver():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def wait(cond, timeout: float = 60.0, step: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError("timed out")


def text(d, css: str) -> str:
    return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css)


def set_field(d, field: str, value: str) -> None:
    d.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        " e.dispatchEvent(new Event('change'));",
        field,
        value,
    )


def send(d, message: str) -> None:
    d.find_element("id", "input").send_keys(message)
    d.find_element("id", "send").click()


def last_answer(d) -> tuple[str, int]:
    got = d.execute_script(
        "const m = document.querySelectorAll('.msg.assistant'); const e = m[m.length - 1];"
        " return e ? [e.querySelector('.content').textContent, Number(e.dataset.chunks || 0)] : ['', 0];"
    )
    return got[0], got[1]


def busy(d) -> bool:
    return not d.find_element("id", "stop").get_attribute("disabled")


def test_chat_page(server, driver, tmp_path) -> None:
    d = driver
    d.get(server.url + "/")
    wait(lambda: text(d, "#status") == "connected" and text(d, "#model") == "tiny")
    served = wait(lambda: text(d, "#stat-served") if text(d, "#stat-served") != "–" else None)
    set_field(d, "temperature", "0")
    set_field(d, "max_tokens", "48")
    set_field(d, "system", "You are terse.")

    # 1. an answer appears token by token
    send(d, "Hello there")
    seen: set[int] = set()
    wait(lambda: busy(d))
    while busy(d):
        seen.add(len(last_answer(d)[0]))
        time.sleep(0.01)
    answer, chunks = last_answer(d)
    assert answer and chunks >= 3 and len(seen - {0}) >= 3, (seen, chunks)
    # the live panel moved on
    wait(lambda: text(d, "#stat-served") != served)
    assert "tok/s" in text(d, "#stat-decode") and "GB" in text(d, "#stat-rss")

    # 2. a second, long answer is stopped midway
    n_log = len(server.lines)
    set_field(d, "max_tokens", "1500")
    send(d, "Tell me more")
    wait(lambda: last_answer(d)[1] >= 3)
    d.find_element("id", "stop").click()
    wait(lambda: not busy(d))
    stopped, _ = last_answer(d)
    time.sleep(0.5)
    assert last_answer(d)[0] == stopped  # no more text after the stop
    assert "stopped" in d.execute_script(
        "const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1].className;"
    )
    server.wait_for("the client went away", after=n_log, timeout=30)

    # 3. the conversation is kept in local storage
    d.refresh()
    wait(lambda: len(d.find_elements("css selector", ".msg")) == 4)
    assert last_answer(d)[0] == stopped and text(d, ".msg.user .content") == "Hello there"

    # 4. model text is rendered as text, never as HTML
    hostile = '<img src=x onerror="window.pwned=1"> **bold** `<b>code</b>`\n```\n<script>window.pwned=1</script>\n```'
    probe = d.execute_script(
        "const div = document.createElement('div'); div.appendChild(Markdown.render(arguments[0]));"
        " document.body.appendChild(div);"
        " const out = [div.querySelectorAll('img,script,b').length, div.querySelectorAll('strong,code,pre').length,"
        " div.textContent, window.pwned || 0];"
        " div.remove(); return out;",
        hostile,
    )
    assert probe[0] == 0 and probe[1] >= 3 and "<img src=x" in probe[2] and probe[3] == 0

    shot = Path(os.environ.get("DSV4_SCREENSHOT") or tmp_path / "chat_page.png")
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    # 5. thinking on: the reasoning is folded (and styled dim) above the answer; copy
    d.find_element("id", "clear").click()
    d.find_element("id", "thinking").click()
    set_field(d, "max_tokens", "6")
    send(d, "Think first")
    wait(lambda: not busy(d) and last_answer(d)[1] >= 1)
    folded = d.execute_script(
        "const r = document.querySelector('.msg.assistant .reasoning');"
        " return [r.hidden, r.open, r.querySelector('.reasoning-text').textContent];"
    )
    assert folded[0] is False and folded[1] is False and folded[2], folded  # a random model rarely closes it
    d.find_element("css selector", ".msg.assistant .copy").click()
    wait(lambda: text(d, ".msg.assistant .copy") == "Copied")
    d.find_element("id", "thinking").click()

    # 6. a long prefill shows its progress, by tokens and layer, from the server
    d.find_element("id", "clear").click()
    set_field(d, "max_tokens", "2")
    send(d, "word " * 3000)

    def progress() -> str | None:
        shown = not d.find_element("id", "progress").get_attribute("hidden")
        line = text(d, "#progress-text") if shown else None
        return line if line and "layer" in line else None  # the layer shows once the first one runs

    line = wait(progress)
    m = re.fullmatch(r"prefill (\d+) of (\d+) tokens \((\d+) cached\), layer ([1-4]) of 4", line)
    assert m and int(m[1]) < int(m[2]) and int(m[2]) > 3000, line
    wait(lambda: not busy(d))
    assert "reading the prompt" not in last_answer(d)[0]

"""The chat page at `/` in a real headless browser (Debian's chromium + chromedriver through
Selenium) against a real `dsv4 serve` on a generated checkpoint with the real V4 tokenizer.

Each test drives one thing a person does: an answer streams in with its figures and the live
pictures, a stop during prefill or decode says so below the answer, conversations survive a
reload and resume on the server's prefix cache, edit / regenerate / versions, a code
block's copy button, per-conversation settings, files dropped or attached (images refused),
the keyboard, both themes, the page at 360 px, the state while the server loads or is busy.
A last test checks that no request of the whole module left the server. Screenshots at
desktop and phone widths go to $DSV4_SCREENSHOT_DIR (`make screenshots` writes docs/), else
to the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text.tokenizer import Tokenizer

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="no chromium/chromedriver here: `sudo apt-get install chromium chromium-driver` (CI installs them)",
)
DESKTOP = (1280, 860)


OURS: set[str] = set()  # the origins of this module's servers (the page talks to nothing else)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=9, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    # small segments: a long prefill lasts long enough for the page to see its layers
    with Server(ckpt, "--ctx", "4096", "--prefill-segment", "16", "--keep-states", "8") as s:
        OURS.add(s.url)
        yield s


@pytest.fixture(scope="module")
def driver():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    size = f"--window-size={DESKTOP[0]},{DESKTOP[1]}"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", size):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.requests = []  # every URL the page asked for, gathered from the performance log
    yield d
    d.quit()


@pytest.fixture(scope="module")
def one_at_a_time(ckpt):
    """A server that decodes one request at a time (`--max-batch 1`): a second request waits in
    its queue (the default batches it beside the first)."""
    with Server(ckpt, "--ctx", "4096", "--prefill-segment", "16", "--max-batch", "1") as s:
        OURS.add(s.url)
        yield s


@pytest.fixture
def page(server, driver):
    yield from _fresh_page(server, driver)


@pytest.fixture
def queued_page(one_at_a_time, driver):
    yield from _fresh_page(one_at_a_time, driver)


def _fresh_page(server, driver):
    """The page with nothing kept (no conversations, no theme, no key), at desktop width."""
    d = driver
    d.set_window_size(*DESKTOP)
    d.get(server.url + "/")
    d.execute_async_script(
        "const done = arguments[arguments.length - 1]; localStorage.clear(); sessionStorage.clear();"
        " const r = indexedDB.deleteDatabase('dsv4stream'); r.onsuccess = r.onerror = r.onblocked = () => done();"
    )
    d.refresh()
    ready(d)
    yield d
    gather_requests(d)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = os.environ.get("DSV4_SCREENSHOT_DIR")
    path = Path(out) if out else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- helpers ---------------------------------------------------------------------------------------


def wait(cond, timeout: float = 120.0, step: float = 0.02, show=None):
    """`cond()` once it is truthy; `show()` describes what the page held when it never was."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError("timed out" + (f"; the page shows {show()!r}" if show else ""))


def js(d, script: str, *args):
    return d.execute_script(script, *args)


def text(d, css: str) -> str | None:
    return js(d, "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css)


def ready(d) -> None:
    wait(lambda: text(d, "#status") == "connected" and text(d, "#model") == "tiny" and not busy(d))
    wait(lambda: not d.find_element("id", "send").get_attribute("disabled"))


def set_field(d, field: str, value) -> None:
    js(
        d,
        "const e = document.getElementById(arguments[0]);"
        " if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];"
        " e.dispatchEvent(new Event('change'));",
        field,
        value,
    )


def field(d, name: str):
    return js(
        d, "const e = document.getElementById(arguments[0]); return e.type === 'checkbox' ? e.checked : e.value;", name
    )


def send(d, message: str) -> None:
    if len(message) > 200:  # typed key by key, a long prompt takes minutes on a loaded machine
        js(d, "document.getElementById('input').value = arguments[0];", message)
    else:
        d.find_element("id", "input").send_keys(message)
    d.find_element("id", "send").click()


def busy(d) -> bool:
    return not d.find_element("id", "stop").get_attribute("disabled")


def answers(d) -> list[dict]:
    return js(
        d,
        "return [...document.querySelectorAll('.msg.assistant')].map(e => ({"
        " content: e.querySelector('.content').textContent, chunks: Number(e.dataset.chunks || 0),"
        " note: e.querySelector('.note').textContent, stats: e.querySelector('.stats').textContent,"
        " reused: e.querySelector('.stats').dataset.reused, stopped: e.classList.contains('stopped'),"
        " versions: (e.querySelector('.versions .count') || {}).textContent || ''}));",
    )


def users(d) -> list[str]:
    return js(d, "return [...document.querySelectorAll('.msg.user .content')].map(e => e.textContent);")


def answer_and_wait(d, message: str) -> dict:
    n = len(answers(d))
    send(d, message)
    wait(lambda: len(answers(d)) == n + 1)
    wait(lambda: not busy(d))
    return answers(d)[-1]


def conversations(d) -> list[str]:
    return js(d, "return [...document.querySelectorAll('#conv-list li .title')].map(e => e.textContent);")


def open_conversation(d, title: str) -> None:
    js(
        d,
        "[...document.querySelectorAll('#conv-list li .title')].find(e => e.textContent === arguments[0]).click();",
        title,
    )
    wait(lambda: text(d, "#conv-list li.current .title") == title)


def reused(stats: dict) -> int:
    m = re.search(r"prompt (\d+) tokens, (\d+) reused", stats["stats"])
    assert m, stats
    return int(m[2])


def drop_files(d, files: list[tuple[str, str, str]], target: str = "input") -> None:
    """A drop of (name, MIME type, text) files on an element, as a drag from the desktop makes."""
    js(
        d,
        "const dt = new DataTransfer();"
        " for (const [name, type, body] of arguments[0]) dt.items.add(new File([body], name, {type}));"
        " document.getElementById(arguments[1]).dispatchEvent("
        " new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));",
        [list(f) for f in files],
        target,
    )


def background(d, css: str = "body") -> str:
    return js(d, "return getComputedStyle(document.querySelector(arguments[0])).backgroundColor;", css)


def gather_requests(d) -> None:
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            d.requests.append(msg["params"]["request"]["url"])


def grant_clipboard(d, origin: str) -> None:
    d.execute_cdp_cmd(
        "Browser.grantPermissions", {"origin": origin, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]}
    )


def clipboard(d) -> str:
    return d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        " navigator.clipboard.readText().then(done, e => done('clipboard error: ' + e.message));"
    )


# ---- the tests -------------------------------------------------------------------------------------


def test_an_answer_streams_with_its_figures_and_live_pictures(server, page, shots) -> None:
    d = page
    set_field(d, "temperature", "0")
    set_field(d, "max_tokens", "48")
    set_field(d, "system", "You are terse.")
    send(d, "Hello there")
    seen: set[int] = set()
    points: set[int] = set()
    wait(lambda: busy(d))
    while busy(d):
        a = answers(d)[-1]
        seen.add(len(a["content"]))
        points.add(int(js(d, "return document.getElementById('plot-canvas').dataset.points || 0;")))
        time.sleep(0.01)
    a = answers(d)[-1]
    assert a["content"] and a["chunks"] >= 3 and len(seen - {0}) >= 3, (seen, a)
    # the plot grew while the answer came in, not only at its end
    assert len(points) >= 3 and max(points) >= 10, points
    m = re.fullmatch(
        r"prompt (\d+) tokens, (\d+) reused · prefill ([\d.]+) tok/s · decode ([\d.]+) tok/s · first token ([\d.]+) s"
        r" · expert hits (\d+)% · disk ([\d.]+) MB",
        a["stats"],
    )
    assert m and int(m[1]) > 5 and float(m[4]) > 0 and float(m[7]) > 0, a["stats"]
    # labelled axes, drawn ink on the canvas
    labels = [text(d, f"#{i}") for i in ("plot-x", "plot-y-left", "plot-y-right")]
    assert labels == ["seconds since the request started", "tokens/s", "disk read MB/s"]
    assert all(d.find_element("id", i).is_displayed() for i in ("plot-x", "plot-y-left", "plot-y-right"))
    assert "tokens/s (left axis" in d.find_element("id", "plot-canvas").get_attribute("aria-label")
    # the expert cache picture: one row per layer, cells for the slots in use, hot and cold
    wait(lambda: int(js(d, "return document.getElementById('experts-canvas').dataset.used || 0;")) > 0)
    caption = text(d, "#experts-text")
    m = re.match(r"(\d+) of (\d+) slots hold experts \((\d+) hot, (\d+) cold\) across 4 layers", caption)
    assert m and 0 < int(m[1]) <= int(m[2]) and int(m[3]) > 0, caption
    # the server-wide table too
    assert "tok/s" in text(d, "#stat-decode") and "GB" in text(d, "#stat-rss")
    js(d, "document.getElementById('settings-box').open = false;")  # the pictures in view
    time.sleep(0.2)
    assert d.save_screenshot(str(shots / "chat-page-desktop.png"))


def test_a_stop_says_where_it_stopped_below_the_answer(server, page) -> None:
    d = page
    set_field(d, "temperature", "0")
    set_field(d, "max_tokens", "1500")
    n_log = len(server.lines)
    send(d, "Tell me more")
    wait(lambda: answers(d) and answers(d)[-1]["chunks"] >= 3)
    d.find_element("id", "stop").click()
    wait(lambda: not busy(d))
    a = answers(d)[-1]
    time.sleep(0.5)
    assert answers(d)[-1]["content"] == a["content"]  # no more text after the stop
    assert a["stopped"] and re.fullmatch(r"stopped by you after \d+ chunks of text", a["note"]), a
    # the note sits below the answer's text
    order = js(
        d,
        "const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return [...m.children].map(e => e.className);",
    )
    assert order.index("note") > order.index("content"), order
    server.wait_for("the client went away", after=n_log, timeout=60)

    # stopped during prefill (Esc this time): no "first token" figure, the prompt position instead
    set_field(d, "max_tokens", "2")
    send(d, "word " * 3000)
    wait(lambda: "reading the prompt:" in (answers(d)[-1]["note"] if len(answers(d)) == 2 else ""))
    d.find_element("id", "input").send_keys("\ue00c")  # Escape
    wait(lambda: not busy(d))
    a = answers(d)[-1]
    assert re.fullmatch(r"stopped by you while the server read the prompt \(\d+ of \d+ tokens\)", a["note"]), a
    assert "first token" not in a["stats"] and not a["content"]
    s = json.loads(urllib.request.urlopen(server.url + "/v1/stats").read())
    wait(lambda: json.loads(urllib.request.urlopen(server.url + "/v1/stats").read())["phase"] == "idle")
    s = json.loads(urllib.request.urlopen(server.url + "/v1/stats").read())
    assert s["last_request"]["time_to_first_token_s"] is None, s["last_request"]


def test_conversations_survive_a_reload_and_resume_on_the_prefix_cache(page, tmp_path) -> None:
    d = page
    set_field(d, "temperature", "0")
    set_field(d, "max_tokens", "6")
    first = answer_and_wait(d, "The first conversation")
    d.find_element("id", "new-conv").click()
    wait(lambda: not users(d))
    set_field(d, "max_tokens", "6")
    answer_and_wait(d, "The second conversation")
    assert conversations(d) == ["The second conversation", "The first conversation"]

    d.refresh()
    ready(d)
    assert conversations(d) == ["The second conversation", "The first conversation"]
    assert users(d) == ["The second conversation"]  # the one open before the reload
    open_conversation(d, "The first conversation")
    assert users(d) == ["The first conversation"] and answers(d)[0]["content"] == first["content"]
    resumed = answer_and_wait(d, "And a follow-up")
    prompt = int(re.search(r"prompt (\d+) tokens", resumed["stats"])[1])
    assert reused(resumed) > prompt // 2, resumed["stats"]  # the first turn came from the server's cache

    # rename, search, delete (the first click only arms the button)
    js(d, "document.querySelector('#conv-list li.current .rename').click();")
    box = d.find_element("css selector", "#conv-list li input")
    box.send_keys("Renamed\n")  # the old title is selected: typing replaces it
    wait(lambda: "Renamed" in conversations(d))
    d.find_element("id", "conv-search").send_keys("second")
    wait(lambda: conversations(d) == ["The second conversation"])
    d.find_element("id", "conv-search").clear()
    js(d, "document.getElementById('conv-search').dispatchEvent(new Event('input'));")
    wait(lambda: len(conversations(d)) == 2)

    # export, delete both, import: the same conversations are back
    d.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    d.find_element("id", "export").click()
    exported = wait(lambda: [p for p in tmp_path.glob("dsv4stream-conversations-*.json")])[0]
    wait(lambda: exported.stat().st_size > 0 and json.loads(exported.read_text()))
    data = json.loads(exported.read_text())
    assert data["format"] == "dsv4stream-conversations" and len(data["conversations"]) == 2
    # Both clicks in one script: the list re-renders when a delete lands, which would disarm a button
    # armed by a separate round trip on a slow machine.
    arm_then_delete = (
        "const b = document.querySelector('#conv-list li .delete'); b.click();"
        "const armed = b.isConnected && b.classList.contains('confirm'); b.click(); return armed;"
    )
    for left in (1, 0):
        assert js(d, arm_then_delete)
        wait(lambda left=left: len([t for t in conversations(d) if t != "untitled"]) == left)
    wait(lambda: not [t for t in conversations(d) if t != "untitled"])
    d.find_element("id", "import-file").send_keys(str(exported))
    # an empty "untitled" conversation opened after the deletes may still be listed for a moment
    named = lambda: sorted(t for t in conversations(d) if t != "untitled")
    wait(lambda: named() == ["Renamed", "The second conversation"], show=lambda: conversations(d))
    bad = tmp_path / "not-an-export.json"
    bad.write_text('{"hello": 1}')
    d.find_element("id", "import-file").send_keys(str(bad))
    wait(lambda: "not a dsv4stream export" in text(d, "#conv-message"))
    d.refresh()
    ready(d)
    assert named() == ["Renamed", "The second conversation"]


def test_edit_regenerate_and_versions(page) -> None:
    d = page
    set_field(d, "temperature", "1")
    set_field(d, "max_tokens", "6")
    answer_and_wait(d, "Pick a colour")
    one = answer_and_wait(d, "Another one")
    # regenerate the last answer: a second version, read from the prefix the server kept
    js(d, "[...document.querySelectorAll('.msg.assistant .regenerate')].pop().click();")
    wait(lambda: busy(d))
    wait(lambda: not busy(d))
    two = answers(d)[-1]
    prompt = int(re.search(r"prompt (\d+) tokens", two["stats"])[1])
    assert two["versions"] == "2/2" and reused(two) >= prompt - 16, two  # at most one prefill segment again
    js(d, "[...document.querySelectorAll('.msg.assistant .prev')].pop().click();")
    wait(lambda: answers(d)[-1]["versions"] == "1/2")
    assert answers(d)[-1]["content"] == one["content"]
    js(d, "[...document.querySelectorAll('.msg.assistant .next')].pop().click();")
    wait(lambda: answers(d)[-1]["versions"] == "2/2" and answers(d)[-1]["content"] == two["content"])

    # edit the first question (Up opens the last one; the first is edited by its button)
    d.find_element("id", "input").send_keys("\ue013")  # ArrowUp
    wait(lambda: js(d, "return !!document.querySelector('.msg.user textarea.edit');"))
    assert js(d, "return document.querySelector('.msg.user textarea.edit').value;") == "Another one"
    d.find_element("id", "input").send_keys("\ue00c")  # Escape: the edit is dropped
    wait(lambda: not js(d, "return !!document.querySelector('.msg.user textarea.edit');"))
    js(d, "document.querySelector('.msg.user .edit').click();")
    area = d.find_element("css selector", ".msg.user textarea.edit")
    area.clear()
    area.send_keys("Pick a number\n")
    wait(lambda: users(d) == ["Pick a number"] and len(answers(d)) == 1)
    wait(lambda: not busy(d))
    assert answers(d)[0]["content"] and "prompt" in answers(d)[0]["stats"]
    versions = js(d, "return document.querySelector('.msg.user .versions .count').textContent;")
    assert versions == "2/2"
    js(d, "document.querySelector('.msg.user .prev').click();")
    wait(lambda: users(d) == ["Pick a colour", "Another one"] and len(answers(d)) == 2)
    d.refresh()
    ready(d)
    assert users(d) == ["Pick a colour", "Another one"]  # the version shown is kept


def test_code_blocks_are_highlighted_and_copied(server, page, tmp_path) -> None:
    d = page
    code = 'def greet(name):\n    return f"hello {name}"  # <b>not bold</b>'
    answer = f"Here:\n\n```python\n{code}\n```\n\nand `inline`."
    root = {"id": "root", "parent": None, "children": ["u"], "sel": 0}
    nodes = {
        "root": root,
        "u": {"id": "u", "parent": "root", "role": "user", "content": "code?", "children": ["a"], "sel": 0},
        "a": {"id": "a", "parent": "u", "role": "assistant", "content": answer, "children": [], "sel": 0},
    }
    export = {"format": "dsv4stream-conversations", "version": 1, "conversations": [{"id": "c", "nodes": nodes}]}
    path = tmp_path / "code.json"
    path.write_text(json.dumps(export))
    d.find_element("id", "import-file").send_keys(str(path))
    wait(lambda: answers(d) and "greet" in answers(d)[0]["content"])
    spans = js(d, "return [...document.querySelectorAll('.msg.assistant pre code span')].map(e => e.className);")
    assert "hljs-keyword" in spans and "hljs-string" in spans, spans
    assert js(d, "return document.querySelector('.msg.assistant .code-head .lang').textContent;") == "python"
    assert js(d, "return document.querySelectorAll('.msg.assistant pre b').length;") == 0
    grant_clipboard(d, server.url)
    d.find_element("css selector", ".msg.assistant .copy-code").click()
    wait(lambda: text(d, ".msg.assistant .copy-code") == "Copied")
    assert clipboard(d) == code
    # the whole answer has its own copy button
    d.find_element("css selector", ".msg.assistant .tools .copy").click()
    wait(lambda: clipboard(d) == answer)

    # model text is rendered as text, never as HTML
    hostile = '<img src=x onerror="window.pwned=1"> **bold** `<b>code</b>`\n```\n<script>window.pwned=1</script>\n```'
    probe = js(
        d,
        "const div = document.createElement('div'); div.appendChild(Markdown.render(arguments[0]));"
        " document.body.appendChild(div);"
        " const out = [div.querySelectorAll('img,script,b').length, div.querySelectorAll('strong,code,pre').length,"
        " div.textContent, window.pwned || 0];"
        " div.remove(); return out;",
        hostile,
    )
    assert probe[0] == 0 and probe[1] >= 3 and "<img src=x" in probe[2] and probe[3] == 0


def test_settings_belong_to_their_conversation(page) -> None:
    d = page
    set_field(d, "max_tokens", "4")
    set_field(d, "system", "System of A")
    set_field(d, "thinking", True)
    efforts = js(d, "return [...document.querySelectorAll('#effort option')].map(o => o.value);")
    assert efforts == ["high", "max"]  # the generated checkpoint's (the preview's) chat format, its default first
    set_field(d, "effort", "max")
    answer_and_wait(d, "Conversation A")
    d.find_element("id", "new-conv").click()
    wait(lambda: not users(d))
    assert field(d, "system") == "" and field(d, "thinking") is True  # sampling carries over, the system prompt not
    set_field(d, "system", "System of B")
    set_field(d, "thinking", False)
    set_field(d, "temperature", "0.3")
    answer_and_wait(d, "Conversation B")
    d.refresh()
    ready(d)
    assert [field(d, k) for k in ("system", "thinking", "temperature")] == ["System of B", False, "0.3"]
    open_conversation(d, "Conversation A")
    assert [field(d, k) for k in ("system", "thinking", "effort", "max_tokens")] == ["System of A", True, "max", "4"]
    # thinking on: the reasoning is folded above the answer
    folded = js(
        d,
        "const r = document.querySelector('.msg.assistant .reasoning');"
        " return [r.hidden, r.open, r.querySelector('.reasoning-text').textContent];",
    )
    assert folded[0] is False and folded[1] is False and folded[2], folded

    # the API key: this tab only, unless "remember" is ticked
    set_field(d, "api_key", "k-123")
    assert js(
        d, "return [sessionStorage.getItem('dsv4stream.api_key'), localStorage.getItem('dsv4stream.api_key')];"
    ) == [
        "k-123",
        None,
    ]
    d.refresh()
    ready(d)
    assert field(d, "api_key") == "k-123"  # same tab
    set_field(d, "remember_key", True)
    assert js(d, "return localStorage.getItem('dsv4stream.api_key');") == "k-123"
    set_field(d, "remember_key", False)
    assert js(d, "return localStorage.getItem('dsv4stream.api_key');") is None
    set_field(d, "api_key", "")


def test_a_dropped_text_file_lands_in_the_prompt_with_its_token_count(server, page, ckpt) -> None:
    d = page
    set_field(d, "max_tokens", "3")
    body = "alpha beta gamma\n" * 40
    drop_files(d, [("notes.txt", "text/plain", body)])
    wait(lambda: js(d, "return document.querySelector('#attachments .chip')?.dataset.tokens;"))
    n = int(js(d, "return document.querySelector('#attachments .chip').dataset.tokens;"))
    assert n == len(Tokenizer.from_checkpoint(ckpt).encode(body))
    assert f"notes.txt · {n} tokens" in text(d, "#attachments")
    # an image and a binary file are refused, each with its reason
    drop_files(d, [("photo.png", "image/png", "\x89PNG"), ("blob.bin", "application/octet-stream", "a\x00b")])
    wait(lambda: "photo.png: images cannot be sent" in (text(d, "#composer-note") or ""))
    assert "blob.bin: not a text file" in text(d, "#composer-note")
    assert js(d, "return document.querySelectorAll('#attachments .chip').length;") == 1
    a = answer_and_wait(d, "Summarise the file")
    assert text(d, ".msg.user .files") == f"notes.txt · {n} tokens"
    prompt = int(re.search(r"prompt (\d+) tokens", a["stats"])[1])
    assert prompt > n  # the file went to the model with the message
    assert js(d, "return document.querySelectorAll('#attachments .chip').length;") == 0
    # a pasted file (the clipboard holds a file) is added the same way
    js(
        d,
        "const dt = new DataTransfer(); dt.items.add(new File(['pasted text'], 'clip.txt', {type: 'text/plain'}));"
        " document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true,"
        " cancelable: true}));",
    )
    wait(lambda: "clip.txt" in (text(d, "#attachments") or ""))
    # Shift+Enter is a new line, not a send
    d.find_element("id", "input").send_keys("line one", "\ue008\ue007\ue000", "line two")  # Shift+Enter, release
    assert field(d, "input") == "line one\nline two" and not busy(d)


def test_the_page_is_usable_at_phone_width(page, shots) -> None:
    d = page
    d.set_window_size(360, 780)
    wait(lambda: js(d, "return window.innerWidth;") <= 360)
    width = js(d, "return window.innerWidth;")
    box = js(d, "return document.getElementById('input').getBoundingClientRect().width;")
    assert box > 0.6 * width, (box, width)
    assert js(d, "return document.documentElement.scrollWidth;") <= width  # nothing sticks out sideways
    rect = "return document.getElementById(arguments[0]).getBoundingClientRect();"
    for drawer, opener in (("convs", "open-convs"), ("panel", "open-panel")):
        wait(lambda id=drawer: js(d, rect, id)["right"] <= 0 or js(d, rect, id)["left"] >= width)  # folded away
        d.find_element("id", opener).click()
        wait(
            lambda id=drawer: (
                0 <= js(d, "return document.getElementById(arguments[0]).getBoundingClientRect().left;", id) < width
            )
        )
        js(d, "document.getElementById('scrim').click();")  # the drawer covers the scrim's middle
    set_field(d, "max_tokens", "8")
    set_field(d, "temperature", "0")
    d.find_element("id", "input").send_keys("Hello from a phone\n")  # Enter sends
    wait(lambda: answers(d))
    wait(lambda: not busy(d))
    msg = js(d, "return document.querySelector('.msg.assistant').getBoundingClientRect().width;")
    assert msg > 0.8 * width
    assert d.save_screenshot(str(shots / "chat-page-phone.png"))
    d.find_element("id", "open-panel").click()
    time.sleep(0.3)
    assert d.save_screenshot(str(shots / "chat-page-phone-panel.png"))


def test_both_themes_apply_and_follow_the_system(page, shots) -> None:
    d = page
    d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    wait(lambda: js(d, "return document.documentElement.dataset.theme;") == "dark")
    dark = background(d)
    d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "light"}]})
    wait(lambda: js(d, "return document.documentElement.dataset.theme;") == "light")
    light = background(d)
    assert dark != light and dark == "rgb(22, 24, 28)" and light == "rgb(246, 246, 244)"
    set_field(d, "theme", "dark")  # the switch wins over the system, and is kept
    assert background(d) == dark
    d.refresh()
    ready(d)
    assert field(d, "theme") == "dark" and background(d) == dark
    assert d.save_screenshot(str(shots / "chat-page-dark.png"))
    set_field(d, "theme", "light")
    assert background(d) == light
    d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def test_the_page_shows_the_queue_and_the_loading_state(one_at_a_time, queued_page) -> None:
    server, d = one_at_a_time, queued_page
    set_field(d, "max_tokens", "2")
    long_prompt = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "busy " * 2500}], "max_tokens": 2}
    ).encode()

    def other_client() -> None:
        req = urllib.request.Request(
            server.url + "/v1/chat/completions", long_prompt, {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=300).read()

    t = threading.Thread(target=other_client)
    t.start()
    wait(lambda: json.loads(urllib.request.urlopen(server.url + "/v1/stats").read())["phase"] == "prefill")
    send(d, "Am I queued?")
    wait(
        lambda: (
            "waiting in the server's queue: 1 request ahead of this one" in (answers(d) or [{"note": ""}])[-1]["note"]
        )
    )
    wait(lambda: "The server is busy: 1 request(s) ahead of yours." in text(d, "#banner"))
    wait(lambda: not busy(d))
    t.join()
    assert answers(d)[-1]["stats"]
    # while the model loads (the server answers "loading"), the page says so and does not send
    js(
        d,
        "window.realFetch = window.fetch; window.fetch = (url, opts) => String(url).endsWith('/v1/stats')"
        " ? Promise.resolve(new Response(JSON.stringify({model: 'tiny', phase: 'loading'}), {status: 200}))"
        " : window.realFetch(url, opts);",
    )
    wait(lambda: "loading the model" in (text(d, "#banner") or ""))
    assert d.find_element("id", "send").get_attribute("disabled")
    js(d, "window.fetch = window.realFetch;")
    wait(lambda: not d.find_element("id", "send").get_attribute("disabled"))


def test_a_long_prefill_shows_its_progress_by_layer(page) -> None:
    d = page
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
    assert answers(d)[-1]["stats"] and "reading the prompt" not in answers(d)[-1]["note"]


def test_no_request_left_the_server(server, driver) -> None:
    gather_requests(driver)
    assert len(driver.requests) > 20
    assert server.url in OURS
    foreign = [
        u
        for u in driver.requests
        if not (any(u.startswith(o + "/") for o in OURS) or u.split(":")[0] in ("data", "blob"))
    ]
    assert not foreign, foreign

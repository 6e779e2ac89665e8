#!/usr/bin/env python3
"""Run llama.cpp's server tests (`tools/server/tests/unit`) against live `dsv4 serve` processes.

Usage: tools/llama_server_tests.py TESTS_DIR --python VENV_PYTHON [--out DIR] [--checkpoint DIR] [--slow] [--no-run]
       [--module test_x.py ...] [--timeout S]

TESTS_DIR is llama.cpp's `tools/server/tests` (never copied into this repo: get it with git, see
docs/serving.md); VENV_PYTHON a Python with its requirements.txt (pytest, openai, requests, ...)
and pytest-timeout. Each module runs in its own pytest (`--junitxml` into --out), with this file
loaded as a pytest plugin (`-p llama_server_tests`): it replaces `utils.ServerProcess.start` so
that where a test would launch `llama-server` with its preset's options, a `dsv4 serve` is started
with the ones that have an equivalent (port, host, `--api-key`, `--ctx` = n_ctx / n_slots, the
model alias as the served model's name, CORS), on a tiny random-weight checkpoint with the real
tokenizer. A server is reused by the next test of the same module when those options are the same
(a start takes ~10 s here; llama.cpp restarts per test), and stopped at the module's end.
llama.cpp's own switch, `DEBUG_EXTERNAL`, would send every test to one server on `PORT` whatever
its preset asks (key, ctx, alias): that is why it is not used. `ServerPreset.load_all` (it only
downloads the GGUF models) does nothing here.

At the end it prints the counts and, for every test that did not pass, the first rule of `RULES`
that matches it (category and reason); a failure no rule explains is printed as `ours?` and makes
the exit status 1. The plugin half imports only the standard library: it runs in VENV_PYTHON.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ENV = "DSV4_LLAMA_HARNESS"  # JSON: {"cmd": [...dsv4 serve prefix], "checkpoint": dir, "work": dir}

# ---- the classification table ------------------------------------------------------------------
# (category, test-id regex, failure-message regex or "", reason); the first rule matching a test
# that did not pass wins. Categories: route (a llama.cpp-only route or server mode), field (a
# llama.cpp-only request or response field), option (a llama-server start-up option with no
# equivalent), model (needs the trained model llama.cpp's tests download: text, token counts, a
# chat template, vision), design (a documented choice of dsv4 serve that differs).
ROUTE, FIELD, OPTION, MODEL, DESIGN = (
    "llama-only route",
    "llama-only field",
    "llama-only option",
    "trained model",
    "design",
)
_FP = "system_fingerprint: llama.cpp's build ('b1234'); after it, llama's chat template's token counts and the trained model's text"
_TPL = "a llama.cpp chat template (--chat-template[-file], /apply-template) and its prompt text"
_ANT = r"^test_compat_anthropic\.py::"
_CHAT = r"^test_chat_completion\.py::"
_SEC = r"^test_security\.py::"

RULES: list[tuple[str, str, str, str]] = [
    # whole modules about llama-server features this server does not have
    (ROUTE, r"^test_embedding\.py", "", "/embeddings, /v1/embeddings: a chat model has no pooling head"),
    (ROUTE, r"^test_rerank\.py", "", "/rerank: reranking models only"),
    (ROUTE, r"^test_infill\.py", "", "/infill: fill-in-the-middle needs a FIM model and llama's route"),
    (ROUTE, r"^test_tokenize\.py", "", "/tokenize, /detokenize"),
    (ROUTE, r"^test_slot_save\.py", "", "/slots/{id}?action=save|restore|erase"),
    (ROUTE, r"^test_router\.py", "", "router mode (--models-dir, /models/load): several models behind one server"),
    (ROUTE, r"^test_stream\.py", "", "router mode's resumable streams (/v1/stream?conv_id=, X-Conversation-Id)"),
    (ROUTE, r"^test_proxy\.py", "", "/cors-proxy: the web UI's proxy"),
    (ROUTE, r"^test_mcp_servers\.py", "", "MCP servers behind the web UI (--mcp-servers-config)"),
    (ROUTE, r"^test_tools_builtin\.py", "", "built-in server tools (--tools) of llama.cpp's web UI"),
    (ROUTE, r"^test_compat_gcp\.py", "", "Vertex AI prediction routes (AIP_MODE)"),
    (ROUTE, r"^test_template\.py", "", "/apply-template with llama.cpp's chat templates"),
    (ROUTE, r"^test_ignore_eos\.py", "", "/completion's ignore_eos and generation_settings"),
    (ROUTE, r"^test_completion\.py::test_(?!.*openai)", "", "/completion (llama.cpp's native route) and its fields"),
    (OPTION, r"^test_lora\.py", "", "LoRA adapters (--lora, /lora-adapters)"),
    (OPTION, r"^test_speculative\.py", "", "draft-model speculative decoding (--model-draft), on /completion"),
    (OPTION, r"^test_sleep\.py", "", "--sleep-idle-seconds and /props' is_sleeping"),
    (OPTION, r"^test_ctx_shift\.py", "", "--context-shift: dropping old tokens past n_ctx (here: a 400)"),
    (OPTION, r"^test_kv_keep_only_active\.py", "", "--cache-ram / idle-slot caching, seen through /slots"),
    (
        MODEL,
        r"^test_vision_api\.py",
        "",
        "images need a vision model (tinygemma3 + mmproj); DeepSeek-V4 reads text only",
    ),
    (
        MODEL,
        r"^test_tool_call\.py::test_.*(real_model|weather|calc_result|thoughts|hello_world)",
        "",
        "a trained tool-calling model (Hermes, Qwen, Llama 3.x ...) with its chat template",
    ),
    # test_basic.py
    (ROUTE, r"^test_basic\.py::test_server_props", "", "/props"),
    (ROUTE, r"^test_basic\.py::test_server_slots", "", "/slots"),
    (ROUTE, r"^test_basic\.py::test_load_split_model", "", "/completion on a split GGUF model"),
    (OPTION, r"^test_basic\.py::test_no_ui", "", "--no-ui"),
    (OPTION, r"^test_basic\.py::test_server_model_aliases_and_tags", "", "--alias with several names, --tags"),
    # test_security.py
    (
        DESIGN,
        _SEC + r"test_access_public_endpoint\[/models\]",
        "",
        "/v1/models needs the key when --api-key is set, as OpenAI's does (llama-server leaves it open)",
    ),
    (ROUTE, _SEC + r"test_access_static_assets_without_api_key", "", "llama.cpp's web UI files (/sw.js ...)"),
    (
        ROUTE,
        _SEC + r"test_correct_api_key",
        "",
        (
            "POST /completions is llama's native /completion there (`content`);"
            " here it is OpenAI's legacy completions (`choices`), key accepted"
        ),
    ),
    (
        DESIGN,
        _SEC
        + r"test_cors_options\[.*Allow-Origin|"
        + _SEC
        + r"test_cors_origins_localhost_reflects\[http://(localhost|127\.0\.0\.1|\[::1\])\]$",
        "",
        (
            "header names are case-insensitive (RFC 9110) and ASGI servers send them lower-case; the test looks"
            " `Access-Control-Allow-Origin` up in a plain dict (the value is the origin, as asked)"
        ),
    ),
    (
        DESIGN,
        _SEC + r"test_cors_options\[.*Credentials",
        "",
        "no Access-Control-Allow-Credentials: the key travels in a header, no cookie is read (and the name case, above)",
    ),
    (
        DESIGN,
        _SEC + r"test_cors_options\[.*Methods",
        "",
        "Allow-Methods lists the methods served, GET, POST, OPTIONS (and the name case, above)",
    ),
    (
        DESIGN,
        _SEC + r"test_cors_options\[.*Headers",
        "",
        "Allow-Headers repeats the headers asked for: a `*` does not cover Authorization (Fetch); and the name case",
    ),
    (
        OPTION,
        _SEC + r"test_cors_origins_localhost_reflects\[http://(localhost|127\.0\.0\.1|\[::1\]):",
        "",
        "llama's `--cors-origins localhost` means any port; --cors-origin takes exact scheme://host[:port]",
    ),
    (
        DESIGN,
        _SEC + r"test_cors_origins_localhost_rejects",
        "",
        "a foreign Origin is refused with 403 before any route (llama: 200 without CORS headers; a browser blocks both)",
    ),
    (OPTION, _SEC + r"test_cors_origins_defaults_to_localhost_with_tools_enabled", "", "--tools"),
    (ROUTE, _SEC + r"test_cors_proxy", "", "/cors-proxy"),
    (OPTION, _SEC + r"test_local_media_file", "", "--media-path and images (a vision model)"),
    # test_chat_completion.py
    (
        FIELD,
        _CHAT + r"test_chat_completion(_stream)?\[|" + _CHAT + r"test_chat_completion_with_openai_library",
        "",
        _FP,
    ),
    (
        MODEL,
        _CHAT + r"test_chat_completion_cached_tokens",
        "",
        "prompt token counts of llama's template (77) over 2 slots",
    ),
    (FIELD, _CHAT + r"test_chat_template(_assistant_prefill)?\b", "", "`__verbose` (--verbose); " + _TPL),
    (
        FIELD,
        _CHAT + r"test_chat_template_continue_final_message",
        "",
        "vLLM's continue_final_message / add_generation_prompt; " + _TPL,
    ),
    (ROUTE, _CHAT + r"test_apply_chat_template", "", "/apply-template"),
    (
        FIELD,
        _CHAT + r"test_completion_with_response_format\[response_format[01]-",
        "",
        "llama's `schema` inside response_format json_object (OpenAI's json_object has none)",
    ),
    (
        FIELD,
        _CHAT + r"test_completion_with_response_format\[response_format2-",
        "",
        "json_schema without its `name` (OpenAI requires it: 400)",
    ),
    (FIELD, _CHAT + r"test_completion_with_json_schema", "", "top-level `json_schema`"),
    (FIELD, _CHAT + r"test_completion_with_grammar", "", "`grammar` (GBNF)"),
    (
        DESIGN,
        _CHAT + r"test_invalid_chat_completion_req\[messages7\]",
        "",
        "two assistant messages in a row are valid OpenAI input; the official encoder renders them",
    ),
    (FIELD, _CHAT + r"test_chat_completion_with_timings_per_token", "", "timings_per_token"),
    (ROUTE, _CHAT + r"test_logit_bias", "", "/tokenize"),
    (
        FIELD,
        _CHAT + r"test_context_size_exceeded",
        "",
        (
            "llama's error type exceed_context_size_error with n_prompt_tokens"
            " and n_ctx; here OpenAI's invalid_request_error, code context_length_exceeded"
        ),
    ),
    (FIELD, _CHAT + r"test_return_progress", "", "return_progress"),
    (FIELD, _CHAT + r"test_chat_completions_multiple_choices", "", "id_slot"),
    (ROUTE, _CHAT + r"test_chat_completions_token_count", "", "/chat/completions/input_tokens"),
    (FIELD, _CHAT + r"test_verbose_debug", "", "`__verbose`"),
    # test_completion.py (the rest is /completion, above)
    (FIELD, r"^test_completion\.py::test_completion_with_openai_library", "", _FP),
    (
        MODEL,
        r"^test_completion\.py::test_completion_stream_with_openai_library",
        "",
        "the stories model's text ('going|bed'); Phi-3.5's joke",
    ),
    # test_compat_oai_responses.py
    (
        MODEL,
        r"^test_compat_oai_responses\.py::test_responses_with_openai_library",
        "",
        "the stories model's text ('Suddenly')",
    ),
    (FIELD, r"^test_compat_oai_responses\.py::test_responses_stream_with_llama_telemetry", "", "timings_per_token"),
    # test_compat_anthropic.py
    (
        DESIGN,
        _ANT + r"test_anthropic_(tool_result_with_image|vision_format_accepted)",
        "",
        "an image to a text-only model is the client's error: 400 naming it (llama: 500)",
    ),
    (
        MODEL,
        _ANT + r"test_anthropic_vision_base64_with_multimodal_model",
        "",
        "a vision model, and an image from huggingface.co",
    ),
    (
        DESIGN,
        _ANT + r"test_anthropic_empty_messages",
        "",
        "Anthropic's API refuses an empty `messages` (400); llama fills in",
    ),
    (
        MODEL,
        _ANT + r"test_anthropic_thinking_history_in_count_tokens",
        "",
        (
            "Qwen3's template; V4's official encoder drops"
            " earlier reasoning unless thinking is on (with `thinking` enabled the count does grow)"
        ),
    ),
    (ROUTE, _ANT + r"test_anthropic_thinking_history_in_template", "", "/apply-template"),
    (
        MODEL,
        _ANT + r"test_anthropic_thinking_with_reasoning_model",
        "",
        "a trained reasoning model (R1-Distill) that closes its reasoning and answers",
    ),
]


@dataclass
class Verdict:
    nodeid: str
    outcome: str  # passed, failed, error, skipped
    category: str  # "pass", "skipped", a category above, or "ours?"
    reason: str
    message: str


def classify(nodeid: str, outcome: str, message: str) -> Verdict:
    if outcome in ("passed", "skipped"):
        return Verdict(nodeid, outcome, "pass" if outcome == "passed" else "skipped", "", message)
    for category, test_re, msg_re, reason in RULES:
        if re.search(test_re, nodeid) and (not msg_re or re.search(msg_re, message)):
            return Verdict(nodeid, outcome, category, reason or category, message)
    return Verdict(nodeid, outcome, "ours?", "no rule explains it", message)


def read_junit(path: Path) -> list[tuple[str, str, str]]:
    """(nodeid `module.py::test[params]`, outcome, message) per test case of a junit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rpartition(".")[2] + ".py"
        nodeid = f"{module}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = el.get("message") or ""
                if not message and (el.text or "").strip():  # an error in a fixture: its last line
                    message = el.text.strip().splitlines()[-1]
                break
        out.append((nodeid, outcome, message))
    return out


# ---- the pytest plugin (runs in llama.cpp's test venv) ------------------------------------------

_running: dict[tuple, subprocess.Popen] = {}


def _server_args(sp) -> tuple:
    """The `dsv4 serve` options llama-server's `sp` (a utils.ServerProcess) has equivalents for:
    (alias, "--host", host, "--port", port, ...); the tuple keys the running servers."""
    slots = sp.n_slots or 1
    args = ["--host", sp.server_host, "--port", str(sp.server_port)]
    if sp.api_key:
        args += ["--api-key", sp.api_key]
    if sp.n_ctx:
        args += ["--ctx", str(max(sp.n_ctx // slots, 16))]  # llama.cpp splits n_ctx between its slots
    # llama-server answers every origin unless --cors-origins narrows it ("localhost" = any port of it)
    origins = sp.cors_origins or "*"
    if origins == "localhost":
        origins = ",".join(f"http://{h}" for h in ("localhost", "127.0.0.1", "[::1]"))
    args += ["--cors-origin", origins]
    return (sp.model_alias or "", *args)


def _checkpoint_named(cfg: dict, alias: str) -> Path:
    """The checkpoint under the model alias's name (the served model id is the directory's name):
    a directory of symlinks to its files."""
    src = Path(cfg["checkpoint"])
    if not alias:
        return src
    d = Path(cfg["work"]) / "models" / alias.replace("/", "_")
    if not d.exists():
        d.mkdir(parents=True)
        for f in src.iterdir():
            (d / f.name).symlink_to(f.resolve())
    return d


def _healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(key: tuple) -> None:
    proc = _running.pop(key)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_all() -> None:
    for key in list(_running):
        _stop(key)


def _start(sp, timeout_seconds: int = 300) -> None:
    cfg = json.loads(os.environ[ENV])
    key = _server_args(sp)
    if key in _running and _running[key].poll() is None:
        return
    for other in [k for k in _running if k[4] == key[4]]:  # the same port: one at a time
        _stop(other)
    alias, *args = key
    cmd = [*cfg["cmd"], str(_checkpoint_named(cfg, alias)), *args]
    log = open(Path(cfg["work"]) / "serve.log", "a")  # noqa: SIM115 (the server writes to it while it runs)
    print(f"llama_server_tests: starting {' '.join(cmd)}", file=log, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    _running[key] = proc
    end = time.monotonic() + timeout_seconds
    while time.monotonic() < end:
        if _healthy(sp.server_host, sp.server_port):
            return
        if proc.poll() is not None:
            _running.pop(key)
            raise RuntimeError(f"dsv4 serve exited with {proc.returncode}; see {cfg['work']}/serve.log")
        time.sleep(0.2)
    raise TimeoutError(f"dsv4 serve did not answer /health within {timeout_seconds} s")


def pytest_configure(config) -> None:
    if ENV not in os.environ:
        return
    import utils  # llama.cpp's tests/utils.py: pytest runs in its folder

    utils.ServerProcess.start = _start
    utils.ServerProcess.stop = lambda self: None  # kept for the next test; stopped at the end
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # it only downloads GGUF files
    atexit.register(stop_all)


def pytest_unconfigure(config) -> None:
    stop_all()


# ---- the driver (runs in this project's venv) ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_checkpoint(work: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dsv4stream import synth

    out = work / "ckpt" / "tiny"
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        synth.make_checkpoint(out, preset="tiny", seed=7, vocab_size=synth.REAL_VOCAB, tokenizer=True)
    return out


def run_module(tests: Path, module: str, python: str, out: Path, env: dict[str, str], timeout: int, slow: bool) -> None:
    xml = out / f"{module.removesuffix('.py')}.xml"
    cmd = [python, "-m", "pytest", f"unit/{module}", "-p", "llama_server_tests", f"--junitxml={xml}", "-q",
           "-o", "junit_family=xunit1", f"--timeout={timeout}", "-p", "no:cacheprovider"]  # fmt: skip
    if not slow:  # as llama.cpp's tests.sh runs them unless SLOW_TESTS=1 (the slow ones download real models)
        cmd += ["-m", "not slow"]
    with open(out / f"{module.removesuffix('.py')}.log", "w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def report(verdicts: list[Verdict], seconds: float) -> str:
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.category] = counts.get(v.category, 0) + 1
    lines = [f"{len(verdicts)} tests in {seconds:.0f} s: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))]
    for v in verdicts:
        if v.category not in ("pass", "skipped"):
            first = v.message.strip().splitlines()[0][:160] if v.message.strip() else ""
            lines.append(f"{v.category:18} {v.nodeid}  [{v.reason}]  {first}")
    return "\n".join(lines)


def table(verdicts: list[Verdict]) -> str:
    """Markdown rows `| category | tests (modules) | reason |`, one per rule that explained a
    test, most tests first (docs/serving.md quotes them)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for v in verdicts:
        if v.category not in ("pass", "skipped"):
            groups.setdefault((v.category, v.reason), []).append(v.nodeid.split("::")[0])
    rows = []
    for (category, reason), mods in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        names = ", ".join(sorted({m.removeprefix("test_").removesuffix(".py") for m in mods}))
        rows.append(f"| {category} | {len(mods)} ({names}) | {reason.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests", type=Path, help="llama.cpp's tools/server/tests")
    p.add_argument("--python", help="Python with the tests' requirements and pytest-timeout")
    p.add_argument("--out", type=Path, default=Path("llama-server-tests"))
    p.add_argument("--checkpoint", type=Path, help="[default: a tiny random checkpoint with the real tokenizer]")
    p.add_argument("--module", action="append", help="test_x.py (repeat); default: every unit/test_*.py")
    p.add_argument("--timeout", type=int, default=300, help="seconds per test")
    p.add_argument("--slow", action="store_true", help="also the tests marked slow (tests.sh's SLOW_TESTS=1)")
    p.add_argument("--no-run", action="store_true", help="classify the junit XML already in --out again")
    a = p.parse_args(argv)
    if not (a.tests / "unit" / "test_basic.py").is_file() or not (a.tests / "utils.py").is_file():
        print(
            f"dsv4: {a.tests} is not llama.cpp's tools/server/tests (no utils.py, unit/test_basic.py)", file=sys.stderr
        )
        return 2
    if a.python is None and not a.no_run:
        print("dsv4: --python PYTHON (with the tests' requirements) is needed to run them", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out.resolve()
    ckpt = a.checkpoint.resolve() if a.checkpoint else work if a.no_run else _make_checkpoint(work)
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", "serve", "--budget", "1", "--threads", "1"]
    env = {**os.environ, "PORT": str(_free_port()), "LLAMA_CACHE": str(work / "llama-cache")}
    env[ENV] = json.dumps({"cmd": cmd, "checkpoint": str(ckpt), "work": str(work)})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(Path.cwd())])
    env.pop("DEBUG_EXTERNAL", None)
    modules = a.module or sorted(f.name for f in (a.tests / "unit").glob("test_*.py"))
    t0, verdicts = time.monotonic(), []
    for m in modules:
        t = time.monotonic()
        xml = work / f"{m.removesuffix('.py')}.xml"
        if not a.no_run:
            run_module(a.tests.resolve(), m, a.python, work, env, a.timeout, a.slow)
        got = [classify(*c) for c in read_junit(xml)] if xml.exists() else None
        if got is None:
            got = [Verdict(f"{m}::<collection>", "error", "ours?", "no junit XML: see the module's log", "")]
        verdicts += got
        print(f"{m}: {len(got)} tests, {sum(v.outcome == 'passed' for v in got)} passed, {time.monotonic() - t:.0f} s",
              flush=True)  # fmt: skip
    text = report(verdicts, time.monotonic() - t0)
    (work / "report.txt").write_text(text + "\n")
    (work / "table.md").write_text(table(verdicts) + "\n")
    print(text)
    return 1 if any(v.category == "ours?" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Compare dsv4stream's chat renderer with DeepSeek's official encoder on random conversations.

Usage: tools/compare_chat.py OFFICIAL_ENCODER.py [--count N] [--seed S] [--fixture OUT.jsonl.gz --keep K]

OFFICIAL_ENCODER.py is a local copy of the official encoder, never part of this repository:
V4.1's `encoding/encoding.py` (vendored, e.g., as `encoding_dsv41.py` in the PyPI wheel
ftllm 1.9.0 or ztxz16/fastllm `tools/fastllm_pytools/`) or V4's `encoding_dsv4.py`. The file
says which release it is: V4.1's defines SYSTEM_SP_TOKEN; V4-0731's REASONING_EFFORT_PROMPTS
(low/high/max); otherwise it is the May preview's (high/max).

Each case is a random OpenAI-shaped conversation (every role the release has, system
messages first and mid-conversation, tools and response formats on system messages, tool
calls with nested JSON arguments (also as text that is not JSON, double-encoded JSON and
parsed values), tool results in and out of call order, reasoning, content as text or text
parts, unicode, text that spells control tokens and DSML tags), thinking on or off, a
random reasoning effort (valid or not) and `drop_thinking` on or off. Both sides render it;
a case agrees when both give the same text or both refuse it. The two deliberate
differences are counted apart, not as agreement: V4.1 has no `developer` role and we refuse
it everywhere, while the official encoder drops such a message silently when it lies
before the last user turn in thinking mode (and raises elsewhere); and a tool-call argument
holding the closing parameter tag is written as JSON with its '<' escaped, where the official
encoder writes it raw and its block no longer parses (issue 40).

Prints the counts and the first differences; exits 1 on any difference. `--fixture` writes
K cases (conversation, options, the official text or its refusal) as gzipped JSON lines for
tests/test_chat_official.py, which checks them without the official file.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.util
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream.errors import UsageError
from dsv4stream.text import chat

LOOKALIKES = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜System｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜DSML｜ calls>",
    "</｜DSML｜ calls>",
    "<｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="x">',
    '<｜DSML｜ invoke name="x">',
    '<｜DSML｜ parameter name="k" string="true">v</｜DSML｜ parameter>',
    "<tool_result>",
    "</tool_result>",
    "<｜action｜>",
    "<｜place▁holder▁no▁799｜>",
    "<|place_holder_mm_span_0436|>",
    "<image>a.png</image>",
    "Reasoning Effort: 75",
    "## Tools",
]
WORDS = [
    "hello", "world", "What is 2+2?", "天气", "日本語", "Привет", "naïve café", "🚀🧑‍🚀", "x", "", " ", "\n", "\n\n",
    "\t", "{", "}", '"', "'", "\\", "::", "a::b", "{{}}", "%s", "null", "true", "42", "-1.5e3", "\u200b", "\r\n",
]  # fmt: skip


def load_official(path: Path) -> tuple[Any, str]:
    spec = importlib.util.spec_from_file_location("official_encoder", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if hasattr(mod, "SYSTEM_SP_TOKEN"):
        return mod, "v41"
    return mod, "0731" if hasattr(mod, "REASONING_EFFORT_PROMPTS") else "preview"


# --- random conversations --------------------------------------------------------------


def text(r: random.Random, n: int = 4, image: bool = False) -> str:
    pool = WORDS + LOOKALIKES + (["<｜deepseek_image｜>"] if image else [])
    return "".join(r.choice(pool) if r.random() < 0.8 else r.choice(WORDS) for _ in range(r.randrange(n + 1)))


def json_value(r: random.Random, depth: int = 0) -> Any:
    kind = r.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return text(r, 3)
    if kind == 1:
        return r.choice([0, 1, -7, 3.25, 1e21, 2**40])
    if kind == 2:
        return r.choice([True, False, None])
    if kind == 3:
        return r.choice(["", "42", "true", "null", "[1]"])
    if kind == 4:
        return text(r, 2)
    if kind in (5, 6):
        return {text(r, 2) or "k": json_value(r, depth + 1) for _ in range(r.randrange(4))}
    return [json_value(r, depth + 1) for _ in range(r.randrange(4))]


def arguments(r: random.Random) -> Any:
    obj = {
        r.choice(["city", "q", "n", "data", "路径", "a b", 'x"y', text(r, 1) or "k"]): json_value(r)
        for _ in range(r.randrange(4))
    }
    kind = r.randrange(9)
    if kind <= 3:
        return json.dumps(obj, ensure_ascii=r.random() < 0.3)
    if kind == 4:
        return json.dumps(json.dumps(obj))  # double-encoded
    if kind == 5:
        return obj  # a parsed value, as some clients send
    if kind == 6:
        return text(r, 3)  # not JSON
    if kind == 7:
        return json.dumps(json_value(r))  # JSON, maybe not an object
    return "{}"


def tool_def(r: random.Random, release: str) -> dict[str, Any]:
    name = r.choice(["get_weather", "search", "run_code", "工具", "a-b_c"])
    if release == "v41" and r.random() < 0.05:
        name = "ns::" + name if r.random() < 0.8 else "a::b::c"
    fn: dict[str, Any] = {"name": name}
    tool: dict[str, Any] = {"type": "function", "function": fn}
    if release == "v41" and r.random() < 0.05:  # the encoder qualifies names with a namespace
        where = tool if r.random() < 0.5 else fn
        where["namespace"] = r.choice(["ns", "", {"name": "ns", "description": text(r, 2)}, {"name": "n2"}, {}, 5])
    if r.random() < 0.8:
        fn["description"] = text(r, 3)
    if r.random() < 0.8:
        props = {text(r, 1) or "p": {"type": r.choice(["string", "integer", "object", "array"]), "description": text(r, 2)}
                 for _ in range(r.randrange(3))}  # fmt: skip
        fn["parameters"] = {"type": "object", "properties": props, "required": list(props)[:1]}
    return tool


def content(r: random.Random, release: str, role: str, image: bool) -> Any:
    if role in ("system", "assistant") and r.random() < 0.05:
        return None
    if release == "v41" and role in ("user", "system", "tool", "assistant") and r.random() < 0.15:
        return [{"type": "text", "text": text(r, 3, image)} for _ in range(r.randrange(3))]
    return text(r, 5, image)


def conversation(r: random.Random, release: str) -> dict[str, Any]:
    roles = ["user", "assistant", "tool", "system", "latest_reminder"]
    weights = [30, 30, 15, 6, 3]
    if release != "v41" or r.random() < 0.05:
        roles.append("developer")
        weights.append(4 if release != "v41" else 20)
    image = release == "v41" and r.random() < 0.03
    msgs: list[dict[str, Any]] = []
    if r.random() < 0.6:
        msgs.append({"role": "system", "content": content(r, release, "system", image)})
    last_ids: list[str] = []
    for _ in range(r.randrange(9)):
        role = r.choices(roles, weights)[0]
        m: dict[str, Any] = {"role": role}
        if role == "assistant":
            m["content"] = content(r, release, role, image)
            if r.random() < 0.5:
                m["reasoning_content"] = text(r, 4, image)
            if r.random() < 0.4:
                calls = []
                for k in range(1 + r.randrange(3)):
                    call: dict[str, Any] = {"type": "function", "function": {"name": tool_def(r, release)["function"]["name"], "arguments": arguments(r)}}  # fmt: skip
                    if r.random() < 0.9:
                        call["id"] = f"call_{k}_{r.randrange(100)}"
                    calls.append(call)
                m["tool_calls"] = calls
                last_ids = [c.get("id", "") for c in calls]
        elif role == "tool":
            m["content"] = content(r, release, role, image)
            if last_ids and r.random() < 0.9:
                m["tool_call_id"] = r.choice(last_ids)
        elif role == "developer":
            m["content"] = text(r, 3) or "d"
        elif role == "latest_reminder":
            m["content"] = text(r, 3)
        else:
            m["content"] = content(r, release, role, image)
        msgs.append(m)
    systems = [m for m in msgs if m["role"] == "system"]
    if systems and r.random() < 0.3:
        r.choice(systems)["tools"] = [tool_def(r, release) for _ in range(1 + r.randrange(3))]
    if systems and r.random() < 0.15:
        r.choice(systems)["response_format"] = r.choice([{}, {"type": "json_object"}, {"type": "object", "properties": {"a": {"type": "string"}}}])  # fmt: skip
    if msgs and msgs[-1]["role"] == "assistant" and r.random() < 0.2:
        msgs[-1]["wo_eos"] = True
    mode = r.choice(["chat", "thinking"])
    if release == "v41":
        efforts: list[Any] = [None, "low", "high", "max", 1, 50, 75, 100, r.randrange(1, 101)]
        bad: list[Any] = [0, 101, "medium", True, 50.0, "75"]
    elif release == "0731":
        efforts, bad = [None, "low", "high", "max"], ["medium", 3]
    else:
        efforts, bad = [None, "high", "max"], ["low", 3]
    effort = r.choice(bad) if msgs and r.random() < 0.02 else r.choice(efforts)
    return {"messages": msgs, "mode": mode, "effort": effort, "drop_thinking": r.random() < 0.8}


# --- both renderers --------------------------------------------------------------------


def official(mod: Any, case: dict[str, Any]) -> str | None:
    """The official text, or None when the official encoder refuses the case."""
    try:
        return mod.encode_messages(
            copy.deepcopy(case["messages"]),
            thinking_mode=case["mode"],
            drop_thinking=case["drop_thinking"],
            reasoning_effort=case["effort"],
        )
    except Exception:  # noqa: BLE001 (whatever it raises: AssertionError, ValueError, NotImplementedError...)
        return None


def ours_messages(case: dict[str, Any]) -> list[chat.Message]:
    """The case's messages as dsv4stream's: OpenAI JSON through `chat.from_openai`, plus what
    the official encoder reads off a message besides (tools, response_format, wo_eos)."""
    msgs = chat.from_openai(case["messages"])
    for k, raw in enumerate(case["messages"]):
        extra: dict[str, Any] = {}
        if raw.get("tools"):
            extra["tools"] = tuple(raw["tools"])
        if "response_format" in raw:
            extra["response_format"] = raw["response_format"]
        if raw.get("wo_eos"):
            extra["unfinished"] = True
        if extra:
            msgs[k] = replace(msgs[k], **extra)
    return msgs


def ours(case: dict[str, Any], release: str) -> str | None:
    """Our text, or None when we refuse the case (a UsageError)."""
    try:
        mode = "think" if case["mode"] == "thinking" else "chat"
        return chat.render(ours_messages(case), mode, case["drop_thinking"], case["effort"], release)
    except UsageError:
        return None


def classify(expected: str | None, got: str | None, case: dict[str, Any], release: str) -> str:
    if expected == got:
        return "same text" if got is not None else "both refuse"
    if release == "v41" and got is None and any(m["role"] == "developer" for m in case["messages"]):
        return "developer refused (deliberate)"
    if expected is not None and got is not None and _holds_param_close(case, release):
        return "closing tag escaped (deliberate)"
    return "DIFFERENT"


def _holds_param_close(case: dict[str, Any], release: str) -> bool:
    """Whether a tool call's argument (as the encoders decode it: JSON text up to twice) holds
    the release's closing parameter tag: the official encoder writes it raw, so its block cannot
    be read back; ours writes such a value as JSON with '<' escaped (`dsml.param_text`)."""
    close = chat.grammar(release).param_close
    for m in case["messages"]:
        for call in m.get("tool_calls") or []:
            args = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
            for _ in range(2):
                if not isinstance(args, str):
                    break
                try:
                    args = json.loads(args)
                except ValueError:
                    break
            if close in json.dumps(args, ensure_ascii=False):
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("official", type=Path, help="local copy of the official encoder (.py)")
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixture", type=Path, help="write cases as gzipped JSON lines here")
    ap.add_argument("--keep", type=int, default=3000, help="cases written to --fixture")
    args = ap.parse_args(argv)
    mod, release = load_official(args.official)
    r = random.Random(args.seed)
    counts: dict[str, int] = {}
    shown, kept = 0, []
    for n in range(args.count):
        case = conversation(r, release)
        expected, got = official(mod, case), ours(case, release)
        verdict = classify(expected, got, case, release)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict == "DIFFERENT" and shown < 5:
            shown += 1
            print(f"case {n}: {json.dumps(case, ensure_ascii=False)[:2000]}")
            print(f"  official: {expected!r}"[:3000])
            print(f"  ours:     {got!r}"[:3000])
        if args.fixture and len(kept) < args.keep and verdict != "DIFFERENT":
            kept.append({**case, "release": release, "expected": expected})
    print(f"{args.official.name} ({release}), seed {args.seed}: {args.count} conversations: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))  # fmt: skip
    if args.fixture:
        args.fixture.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in kept).encode()
        args.fixture.write_bytes(gzip.compress(lines, compresslevel=9, mtime=0))  # same bytes every run
        print(f"{args.fixture}: {len(kept)} cases")
    return 1 if counts.get("DIFFERENT") else 0


if __name__ == "__main__":
    sys.exit(main())

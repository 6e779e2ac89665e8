"""Prefix reuse that never misses, through the official `openai` client against a live server:
a repeated request, the turn after a thinking reply, the next plain turn in several trials,
and the first request after a restart with --kv-cache all report `cached_tokens` as high as
nothing-changed allows; a --kv-cache folder that cannot be written costs one warning line."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from server_proc import Server

from dsv4stream import synth

CTX = 768
GEN = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reuse") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=4, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def kvdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def server(ckpt, kvdir):
    # a large prefill segment, as planned for real prompts: reuse may not hang on segment boundaries
    with Server(ckpt, "--kv-cache", str(kvdir), "--ctx", str(CTX), "--prefill-segment", "4096") as s:
        yield s


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(srv: Server, messages, **kw):
    return client(srv).chat.completions.create(model="tiny", messages=messages, max_tokens=GEN, **kw)


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_repeated_request_reuses_all_but_the_last_prompt_token(server) -> None:
    m = [{"role": "user", "content": "Regenerate this answer, please: what is a fox?"}]
    first = ask(server, m, temperature=0)
    again = ask(server, m, temperature=0)
    assert cached(again) >= again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    sampled = ask(server, m, temperature=1.0, seed=3)  # a regenerate with sampling: the same reuse
    assert cached(sampled) >= sampled.usage.prompt_tokens - 1


def test_the_turn_after_a_thinking_reply_reuses_the_whole_previous_prompt_but_its_think_tag(server) -> None:
    think = {"thinking": {"type": "enabled"}}
    m1 = [{"role": "user", "content": "Think about rivers, then answer."}]
    r1 = ask(server, m1, temperature=0, extra_body=think)
    m2 = [*m1, {"role": "assistant", "content": r1.choices[0].message.content or "ok"}]
    m2.append({"role": "user", "content": "And lakes?"})
    r2 = ask(server, m2, temperature=0, extra_body=think)
    # the renderer drops the old reasoning and closes the turn with </think> where <think> was
    assert cached(r2) >= r1.usage.prompt_tokens - 1


@pytest.mark.parametrize("trial", range(4))
def test_the_next_plain_turn_reuses_the_whole_previous_reply(server, trial) -> None:
    m1 = [{"role": "user", "content": f"Trial {trial}: tell me something odd about the number {7 * trial + 3}."}]
    r1 = ask(server, m1, temperature=1.0, seed=100 + trial)
    m2 = [*m1, {"role": "assistant", "content": r1.choices[0].message.content or ""}]
    m2.append({"role": "user", "content": "Go on."})
    r2 = ask(server, m2, temperature=0)
    assert cached(r2) >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1, (r1.usage, r2.usage)


def test_the_first_request_after_a_restart_reuses_the_disk_cache(server, ckpt, tmp_path) -> None:
    m = [{"role": "user", "content": "Remember this across a restart: seven swans."}]
    before = ask(server, m, temperature=0)
    # one server per folder (a second one while the first runs is refused): stop, then restart
    args = ("--kv-cache", str(tmp_path / "kv"), "--ctx", str(CTX), "--prefill-segment", "4096")
    with Server(ckpt, *args) as first:
        ask(first, m, temperature=0)
    with Server(ckpt, *args) as restarted:
        r = ask(restarted, m, temperature=0)
        assert cached(r) >= r.usage.prompt_tokens - 1
        assert r.choices[0].message.content == before.choices[0].message.content
        assert "Traceback" not in restarted.log


def test_an_unwritable_kv_cache_folder_costs_one_warning_and_the_server_serves(ckpt) -> None:
    # /proc takes no new files, even for root (a chmod 555 folder would not stop root)
    with Server(ckpt, "--kv-cache", "/proc", "--ctx", str(CTX)) as srv:
        for _ in range(2):
            r = ask(srv, [{"role": "user", "content": "hello"}], temperature=0)
            assert r.choices[0].finish_reason in ("stop", "length")
        warnings = [ln for ln in srv.lines if "--kv-cache /proc" in ln]
        assert len(warnings) == 1 and "serving without the disk cache" in warnings[0], srv.log
        assert "Traceback" not in srv.log

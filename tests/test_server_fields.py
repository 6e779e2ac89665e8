"""Nothing a client sends is silently ignored: every request field of every endpoint is read,
or refused with a 400 that names it; docs/serving.md's parameter tables list exactly the
fields the request models declare plus the refused ones, and every field the official
`openai` and `anthropic` clients know. In-process (TestClient): the refusals come before
anything reaches the engine."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from dsv4stream import synth
from dsv4stream.server.app import create_app
from dsv4stream.server.decoding import Controls, Picker
from dsv4stream.server.responses import ResponsesRequest, encrypt, input_messages
from dsv4stream.server.schemas import REFUSED, AnthropicRequest, ChatRequest, CompletionRequest, CountRequest
from dsv4stream.server.toolkit import ServerState
from dsv4stream.text.sampler import SamplingParams
from dsv4stream.text.tokenizer import Tokenizer

DOC = Path(__file__).parents[1] / "docs" / "serving.md"
MSG = [{"role": "user", "content": "hi"}]
# endpoint: (its table's heading, request model, a minimal valid body, the official client's parameters)
ENDPOINTS = {
    "/v1/chat/completions": ("### `/v1/chat/completions`", ChatRequest, {"messages": MSG},
                             chat_create_params.CompletionCreateParamsBase),
    "/v1/completions": ("### `/v1/completions`", CompletionRequest, {"prompt": "hi"},
                        completion_create_params.CompletionCreateParamsBase),
    "/v1/responses": ("### `/v1/responses`", ResponsesRequest, {"input": "hi"},
                      response_create_params.ResponseCreateParamsBase),
    "/v1/messages": ("### `/v1/messages` (Anthropic)", AnthropicRequest, {"messages": MSG, "max_tokens": 4},
                     message_create_params.MessageCreateParamsBase),
    "/v1/messages/count_tokens": ("### `/v1/messages/count_tokens` (Anthropic)", CountRequest, {"messages": MSG},
                                  message_count_tokens_params.MessageCountTokensParams),
}  # fmt: skip


def table(heading: str) -> tuple[set[str], set[str]]:
    """(every field the table names, the fields of its `refused: 400` rows): the names in
    backticks in each row's first cell, outside parentheses (which list a field's parts)."""
    text = DOC.read_text(encoding="utf-8")
    assert heading + "\n" in text, f"docs/serving.md has no {heading!r} section"
    section = text.split(heading + "\n", 1)[1].split("\n#", 1)[0]
    names, refused = set(), set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        first, status = row.split(" | ")[0], row.split(" | ")[1]
        fields = set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", first)))
        names |= fields
        if status.startswith("refused"):
            refused |= fields
    return names, refused


def declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("path", ENDPOINTS)
def test_the_parameter_table_lists_exactly_what_the_request_model_reads_and_refuses(path) -> None:
    heading, model, _, _ = ENDPOINTS[path]
    names, refused = table(heading)
    assert names == declared(model) | refused
    assert not refused & declared(model)
    assert refused <= set(REFUSED), "each refused field says why in schemas.REFUSED"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_the_parameter_table_covers_every_field_the_official_client_knows(path) -> None:
    heading, _, _, params = ENDPOINTS[path]
    names, _ = table(heading)
    assert set(params.__annotations__) - names == set()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = synth.make_checkpoint(tmp_path_factory.mktemp("fields") / "tiny", preset="tiny", seed=3,
                                 vocab_size=synth.REAL_VOCAB, tokenizer=True)  # fmt: skip
    srv = ServerState("tiny", Tokenizer.from_checkpoint(ckpt), 512, lambda line: None)
    # a worker that must never be reached: every request here is refused while it is checked
    srv.worker = SimpleNamespace(queued=0, submit=lambda job: pytest.fail("a refused request reached the engine"))
    with TestClient(create_app(srv)) as c:
        yield c


def refusal(client, path: str, body: dict) -> str:
    r = client.post(path, json=body)
    assert r.status_code == 400, (path, body, r.text)
    err = r.json()["error"]
    return err["message"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_refused_or_unknown_field_is_a_400_that_names_it(client, path) -> None:
    heading, _, body, _ = ENDPOINTS[path]
    _, refused = table(heading)
    for name in sorted(refused):
        message = refusal(client, path, {**body, name: True})
        assert message.startswith(f"{name}: not supported here ({REFUSED[name]})"), message
    message = refusal(client, path, {**body, "frobnicate": 1})
    assert message.startswith("frobnicate: not supported here (not a field this server reads)")


@pytest.mark.parametrize(
    ("path", "extra", "names"),
    [
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities.1"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.0.name"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
         "tools.0.function.examples"),
        ("/v1/chat/completions", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/responses", {"truncation": "auto"}, "truncation"),
        ("/v1/responses", {"include": ["file_search_call.results"]}, "include.0"),
        ("/v1/responses", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/responses", {"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ("/v1/responses", {"text": {"verbosity": "high"}}, "text.verbosity"),
        ("/v1/responses", {"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name"),
        ("/v1/responses", {"tools": [{"type": "function", "name": "f", "output_schema": {}}]}, "tools.0.output_schema"),
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]},
         "input.0.encrypted_content"),
        ("/v1/messages", {"thinking": {"type": "enabled"}}, "thinking"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 9, "display": "omitted"}},
         "thinking.display"),
        ("/v1/messages", {"output_config": {"effort": "high"}}, "output_config.effort"),
        ("/v1/messages", {"tool_choice": {"type": "tool"}}, "tool_choice"),
        ("/v1/messages", {"tools": [{"name": "f", "input_schema": {}, "input_examples": []}]},
         "tools.0.input_examples"),
        ("/v1/messages", {"metadata": {"user_id": "u", "plan": "pro"}}, "metadata.plan"),
    ],
)  # fmt: skip
def test_values_with_no_meaning_here_are_a_400_naming_the_field(client, path, extra, names) -> None:
    _, _, body, _ = ENDPOINTS[path]
    message = refusal(client, path, {**body, **extra})
    assert message.startswith(f"{names}: "), message


def test_a_thinking_budget_forces_the_end_of_the_reasoning() -> None:
    think_end, vocab = 7, 12
    picker = Picker(Controls(think_budget=3), SamplingParams(0.0, 0, 1.0, 0.0, 1), vocab, np.random.default_rng(0), [],
                    20, thinking=True, think_end=think_end)  # fmt: skip
    logits = np.zeros(vocab, dtype=np.float32)
    logits[2] = 5.0  # the model's favourite, never </think>
    assert [picker(logits) for _ in range(5)] == [2, 2, 2, think_end, 2]
    free = Picker(Controls(), SamplingParams(0.0, 0, 1.0, 0.0, 1), vocab, np.random.default_rng(0), [], 20,
                  thinking=True, think_end=think_end)  # fmt: skip
    assert [free(logits) for _ in range(5)] == [2] * 5


def test_encrypted_reasoning_comes_back_as_the_reasoning_it_sealed() -> None:
    sealed = encrypt("step one, step two")
    items = [{"type": "reasoning", "summary": [], "encrypted_content": sealed},
             {"type": "message", "role": "assistant", "content": "done"}]  # fmt: skip
    assert input_messages(ResponsesRequest.model_validate({"input": items}).input) == [
        {"role": "assistant", "content": "done", "reasoning_content": "step one, step two"}
    ]


@pytest.mark.parametrize(
    ("path", "extra", "names"),
    [
        ("/v1/messages", {"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ("/v1/messages", {"tools": [{"name": "a b", "input_schema": {}}]}, "tools.0.name"),
        ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages.0.content.0.source.type"),
        ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "r"}]}]},
         "messages.0.content.0"),
        ("/v1/messages/count_tokens", {"system": [{"type": "text", "text": 5}]}, "system.0.text"),
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": [], "content": {"type": "reasoning_text"}}]},
         "input.0.content"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.image_url"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
         "text.format.name"),
        ("/v1/chat/completions", {"logit_bias": {"7" * 4500: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)  # fmt: skip
def test_a_wrong_value_deep_in_a_body_is_a_400_naming_the_clients_own_field(client, path, extra, names) -> None:
    """Checked by the endpoint's own model, or by the chat request it is translated into and
    then told in the client's API's names (not OpenAI chat's `stop` for `stop_sequences`)."""
    _, _, body, _ = ENDPOINTS[path]
    message = refusal(client, path, {**body, **extra})
    assert message.startswith(f"{names}: "), message


def test_page_tokens_reads_text_and_refuses_anything_else(client) -> None:
    assert client.post("/v1/page/tokens", json={"text": "hi"}).json()["characters"] == 2
    assert refusal(client, "/v1/page/tokens", {"text": "hi", "lang": "en"}).startswith("lang: not supported here")
    assert refusal(client, "/v1/page/tokens", {"text": 5}).startswith("text: ")

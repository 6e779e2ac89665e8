"""Both chat renderers against texts made by DeepSeek's official encoders, case by case.

The fixtures (tests/fixtures/chat/*.jsonl.gz) were written by `tools/compare_chat.py` from
local copies of the official encoders, which are not part of this repository:
- v41.jsonl.gz: V4.1's `encoding/encoding.py` as vendored in the PyPI wheel ftllm 1.9.0
  (`ftllm/encoding_dsv41.py`, sha256 dc3ac9bf...; its header names DeepSeek-V4.1-Flash-1017's
  encoding.py, plus a pass-through hook left unused), 3,000 random conversations (seed 7);
- v4-preview.jsonl.gz: V4's `encoding_dsv4.py` from the same wheel (the May preview's
  reasoning efforts; sha256 15d25b3d...), 2,000 conversations (seed 7).
Each line holds a conversation (OpenAI JSON, tools and response formats on system messages,
`wo_eos` for an unfinished last turn), the mode, effort and drop_thinking, and the official
text, or null where the official encoder refused the case. Regenerate with
  tools/compare_chat.py OFFICIAL.py --count 3500 --seed 7 --fixture OUT --keep 3000
The same tool compared tens of thousands more conversations (docs/chat.md gives the counts).
"""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from dsv4stream.text import chat
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
TOOL = Path(__file__).resolve().parents[1] / "tools" / "compare_chat.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("compare_chat", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases(name: str) -> list[dict]:
    with gzip.open(FIXTURES / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    ("name", "release", "least"), [("v41.jsonl.gz", "v41", 3000), ("v4-preview.jsonl.gz", "preview", 2000)]
)
def test_every_case_renders_as_the_official_encoder(name, release, least):
    tool = load_tool()
    got = {"same text": 0, "both refuse": 0, "developer refused (deliberate)": 0, "closing tag escaped (deliberate)": 0}
    bad = []
    for n, case in enumerate(cases(name)):
        assert case["release"] == release
        verdict = tool.classify(case["expected"], tool.ours(case, release), case, release)
        if verdict not in got:
            bad.append(n)
        else:
            got[verdict] += 1
    assert not bad, f"cases {bad[:10]} differ from the official encoder"
    assert sum(got.values()) >= least and got["same text"] > 0.8 * least and got["both refuse"] > 0


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    out = {}
    for family in ("v4", "v41"):
        d = tmp_path_factory.mktemp(family)
        write_tokenizer_files(d, family)
        cfg = (
            {"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}
            if family == "v41"
            else {"vocab_size": 129280}
        )
        (d / "config.json").write_text(json.dumps(cfg))
        out[family] = Tokenizer.from_checkpoint(d)
    return out


@pytest.mark.parametrize(
    ("name", "release", "family"), [("v41.jsonl.gz", "v41", "v41"), ("v4-preview.jsonl.gz", "preview", "v4")]
)
def test_ids_equal_the_official_texts_tokenized_whole(toks, name, release, family):
    # Where no content spells an added token, encoding the pieces gives exactly the ids of the
    # official text tokenized in one call (what the official pipeline feeds the model).
    tok = toks[family]
    spellings = [t.content for t in tok._hf.get_added_tokens_decoder().values()]
    tool = load_tool()
    checked = 0
    for case in cases(name):
        if case["expected"] is None or tool.ours(case, release) is None:
            continue  # refused (by both, or V4.1's developer role by us)
        mode = "think" if case["mode"] == "thinking" else "chat"
        pieces = chat.pieces(tool.ours_messages(case), mode, case["drop_thinking"], case["effort"], release)
        if any(s in text for text, is_content in pieces.items if is_content for s in spellings):
            continue  # content that spells an added token: that one stays text (test_chat_injection.py)
        assert tok.encode_prompt(pieces.items) == tok.encode(case["expected"])
        checked += 1
    assert checked > 300

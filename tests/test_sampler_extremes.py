"""The sampler at its extremes: never a banned id, never a pick from a distribution that is not
finite, whatever the temperature, top-k, top-p and min-p (property tests), and the defined
behaviour at the edges: a temperature that rounds to nothing is greedy, inf and NaN are refused,
NaN/+inf logits are a NumericsError, and the draw never lands on an id of zero probability."""

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4stream.errors import NumericsError, UsageError
from dsv4stream.text import sampler
from dsv4stream.text.sampler import SamplingParams, banned_ids, make_pick
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

VOCAB = 64

temperatures = st.one_of(
    st.just(0.0),
    st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-320, 5e-324, 1e-45, 1.1754943508222875e-38, 1e-30, 1e-10, 1.0, 1e10, 1e38, 1.7e308]),
)
params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_k=st.integers(0, VOCAB + 5),
    top_p=st.one_of(st.floats(min_value=1e-12, max_value=1.0, exclude_min=False), st.just(1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1.0)),
    seed=st.integers(0, 2**31 - 1),
)
finite_or_masked = st.one_of(
    st.floats(
        min_value=-3.0000000054977558e38,
        max_value=3.0000000054977558e38,
        allow_nan=False,
        allow_infinity=False,
        width=32,
    ),
    st.just(-math.inf),
    st.sampled_from([0.0, 1.0, 88.0, -88.0, 3.4e38, -3.4e38]),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=params,
    logits=st.lists(finite_or_masked, min_size=VOCAB, max_size=VOCAB),
    banned=st.sets(st.integers(0, VOCAB - 1), max_size=VOCAB - 1),
    n_ids=st.integers(1, VOCAB),
)
def test_never_a_banned_or_masked_id(p, logits, banned, n_ids):
    x = np.asarray(logits, dtype=np.float32)
    allowed = [i for i in range(n_ids) if i not in banned]
    pick = make_pick(p, n_ids, np.random.default_rng(p.seed), sorted(banned))
    if not allowed or not np.isfinite(x[allowed]).any():
        with pytest.raises(NumericsError):
            pick(x)
        return
    for _ in range(3):
        got = pick(x)
        assert got in allowed and np.isfinite(x[got])


@settings(max_examples=300, deadline=None)
@given(
    p=params,
    logits=st.lists(finite_or_masked, min_size=8, max_size=8),
    poison=st.sampled_from([math.nan, math.inf]),
    where=st.integers(0, 7),
)
def test_never_a_pick_from_non_finite_logits(p, logits, poison, where):
    x = np.asarray(logits, dtype=np.float32)
    x[where] = poison
    with pytest.raises(NumericsError):
        sampler.sample(x, p, np.random.default_rng(0))
    # a banned id may hold anything: it never enters the distribution
    pick = make_pick(p, 8, np.random.default_rng(0), [where])
    if np.isfinite(np.delete(x, where)).any():
        assert pick(x) != where


@pytest.mark.parametrize("t", [1e-320, 5e-324, 1e-40])
def test_a_temperature_that_rounds_to_nothing_is_greedy(t):
    x = np.array([0.0, 5.0, 5.0, -1.0], np.float32)  # tied top: greedy takes the lower id
    p = SamplingParams(temperature=t, top_k=2, top_p=0.5, min_p=0.1)
    assert p.greedy and all(sampler.sample(x, p, np.random.default_rng(s)) == 1 for s in range(20))
    small = SamplingParams(temperature=1e-30)  # above float32's smallest normal: samples, among the tie only
    assert not small.greedy and {sampler.sample(x, small, np.random.default_rng(s)) for s in range(40)} == {1, 2}


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"temperature": -1.0},
        {"temperature": True},
        {"top_k": -1},
        {"top_k": 1.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"min_p": -0.1},
        {"min_p": math.inf},
    ],
)
def test_parameters_out_of_range_are_refused(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)


def test_the_draw_never_lands_on_zero_probability():
    class Edge:  # u just below 1: the running sum may end below it after rounding
        def random(self):
            return 1.0 - 2.0**-53

    x = np.full(1000, -np.inf)
    x[:997] = np.random.default_rng(3).standard_normal(997)  # its running sum ends at 0.9999999999999991
    assert np.cumsum(sampler.softmax(x))[-1] < Edge().random()
    for _ in range(5):
        got = sampler.draw(x, Edge())
        assert np.isfinite(x[got]) and got < 997


@pytest.fixture(scope="module", params=["v4", "v41"])
def tok(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_tokenizer_files(d, request.param)
    cfg = (
        {"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}
        if request.param == "v41"
        else {"vocab_size": 129280}
    )
    (d / "config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_checkpoint(d)


def test_control_ids_are_banned_but_reply_tokens_are_not(tok):
    banned = set(banned_ids(tok))
    every_added = set(tok._hf.get_added_tokens_decoder())
    reply = {tok.special.eos, tok.special.think, tok.special.think_end, tok.special.dsml}
    assert banned == every_added - reply
    assert {0, tok.special.user, tok.special.assistant, 128799, 129264, 129270, 129279} <= banned
    if tok.family == "v41":  # not marked special in V4.1's file, banned all the same
        assert not tok._hf.get_added_tokens_decoder()[128799].special
    assert banned_ids(tok, allow_special=True) == [] and banned_ids(None) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=params, seed=st.integers(0, 1000))
def test_real_vocabulary_never_samples_a_control_id(tok, p, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tok.vocab_size).astype(np.float32)
    banned = banned_ids(tok)
    x[banned] = 50.0  # the control tokens are by far the most likely
    x[128799] = x[129264] = 1e30  # System, image: more so
    got = make_pick(p, tok.n_tokens, rng, banned)(x)
    assert got not in set(banned) and 0 <= got < tok.n_tokens

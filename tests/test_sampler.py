"""The sampler alone: its frequencies against the distributions it claims, a
seeded row's independence of its neighbours, greedy, the masks, the logprobs;
and Sampling's checks and record. The torch path runs the same tests where
torch is installed (CI has none)."""
import importlib.util
import math

import numpy as np
import pytest

import engine
from engine.batching import sampler
from engine.batching.sampler import CANDIDATES, WIDEN, Rows, score
from engine.sampling import HEAD_BYTES, MAX_STOP_TOKEN_IDS, RECORD_BYTES, RECORD_DTYPE, Sampling
from engine.tensors import BadResult

NO_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                              reason="torch is not installed")
# "torch": CPU tensors, which the numpy path reads through a view; "torch-ops": the same made
# to take the torch path, as tensors on a GPU do
BACKENDS = ["numpy", pytest.param("torch", marks=NO_TORCH),
            pytest.param("torch-ops", marks=NO_TORCH)]


@pytest.fixture(autouse=True)
def torch_ops(request, monkeypatch):
    if "torch-ops" in request.node.name:
        monkeypatch.setattr(sampler, "TORCH_CPU_AS_NUMPY", False)

PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
LOGITS = np.log(PROBS).astype(np.float32) + 1.5  # a shift: softmax must not care
DRAWS = 20_000
# Upper critical values of chi-square at alpha = 0.001, by degrees of freedom (NIST/SEMATECH
# e-Handbook of Statistical Methods, 1.3.6.7.4): at a fixed seed, a right sampler passes with
# room, and one off by a few points of probability fails by far.
CHI2_CRITICAL_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def on(backend, x):
    if backend.startswith("torch"):
        import torch
        return torch.from_numpy(np.ascontiguousarray(x))
    return x


def reference(probs, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The documented rule, one row, plainly: temperature, then min_p, top_k and top_p,
    each keeping p at or above a threshold among those still kept."""
    p = probs ** (1.0 / temperature)
    p = p / p.max()
    keep = p >= min_p
    if top_k:
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    if top_p < 1:
        kept = np.sort(p[keep])[::-1]
        first = int(np.argmax(np.cumsum(kept) >= top_p * kept.sum()))
        keep &= p >= kept[first]
    p = np.where(keep, p, 0)
    return p / p.sum()


def chi_square(tokens, expected):
    counts = np.bincount(tokens, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, f"drew truncated ids: {counts}"
    live = expected > 0
    e = expected[live] * len(tokens)
    return float(((counts[live] - e) ** 2 / e).sum()), int(live.sum()) - 1


CASES = [dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=3), dict(top_p=0.7),
         dict(min_p=0.3), dict(temperature=0.7, top_k=5, top_p=0.8, min_p=0.2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items())
                         or "plain")
def test_frequencies_match_the_distribution(backend, params):
    rows = Rows(DRAWS, seed=1234)
    rows.add([Sampling(**params)] * DRAWS)
    tokens = rows.sample(on(backend, np.tile(LOGITS, (DRAWS, 1)))).tokens
    statistic, df = chi_square(tokens, reference(PROBS, **params))
    assert statistic < CHI2_CRITICAL_001[df], (statistic, df)


def test_the_chi_square_check_can_fail():
    """A sampler that ignored top_p would be caught (the check has power)."""
    rows = Rows(DRAWS, seed=1234)
    rows.add([Sampling()] * DRAWS)
    tokens = rows.sample(np.tile(LOGITS, (DRAWS, 1))).tokens
    with pytest.raises(AssertionError, match="truncated"):
        chi_square(tokens, reference(PROBS, top_p=0.7))
    statistic, df = chi_square(tokens, reference(PROBS, temperature=0.9))
    assert statistic > CHI2_CRITICAL_001[df]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab, past", [(4 * CANDIDATES, CANDIDATES),
                                         (40 * CANDIDATES, WIDEN**2 * CANDIDATES)])
def test_a_nucleus_wider_than_the_candidates_reads_more(backend, vocab, past):
    # p_j = exp(-2 j / V): top_p 0.9 keeps the first 75 % of the ids, past the first candidates
    # (and past 16 times as many too, for the larger vocabulary)
    logits = np.tile(-np.arange(vocab, dtype=np.float32) * 2 / vocab, (4, 1))
    kept = reference(np.exp(logits[0].astype(np.float64)), top_p=0.9) > 0
    assert past < kept.sum() < vocab and kept[:kept.sum()].all()
    rows = Rows(4, seed=7)
    rows.add([Sampling(top_p=0.9)] * 4)
    seen = np.concatenate([rows.sample(on(backend, logits)).tokens for _ in range(25)])
    assert kept[seen].all() and seen.max() > past  # and with too few read, 10 % past the nucleus


def large_case(name):
    """(logits [1024], Sampling, the kept ids' p): rows where the candidates
    are found by threshold, at the edges of what they must hold."""
    vocab = 1024
    x = np.random.default_rng(8).uniform(-6, -4, vocab).astype(np.float32)
    if name == "tie at the cut, one group":  # ids 7 + 64 j: all in group 7 (id mod 16)
        x[5], x[7:7 + 5 * 64:64] = 2.0, 1.0
        return x, Sampling(top_k=2), {5: 1.0, **{i: math.exp(-1) for i in range(7, 327, 64)}}
    if name == "p tied in rounding past t":  # x in [0, 0.029): (x - 1e6) / 1e6 rounds to -1
        x[:] = -1e6
        x[3] = 1e6
        x[[100, 300, 500, 700, 900]] = [0.025, 0.0, 0.02, 0.01, 0.005]
        return x, Sampling(top_k=2, temperature=1e6), {
            3: 1.0, **{i: math.exp(-1) for i in (100, 300, 500, 700, 900)}}
    # top_p alone, its heavy ids where the guess reads (ids 8 j), one where it does not
    x = np.full(vocab, np.log(0.05 / vocab), np.float32)
    x[[0, 8, 3]] = np.log([1.0, 0.5, 0.45])
    return x, Sampling(top_p=0.9), {0: 1.0, 8: 0.5, 3: 0.45}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["tie at the cut, one group", "p tied in rounding past t",
                                  "top_p's guess short"])
def test_a_large_vocabulary_keeps_what_the_rule_keeps(backend, case):
    x, params, kept = large_case(case)
    draws = 1500
    rows = Rows(draws, seed=99)
    rows.add([params] * draws)
    tokens = rows.sample(on(backend, np.tile(x, (draws, 1)))).tokens
    expected = np.zeros(len(x))
    expected[list(kept)] = list(kept.values())
    statistic, df = chi_square(tokens, expected / expected.sum())
    assert statistic < CHI2_CRITICAL_001[df], (statistic, df)


def steps_of_logits(steps, n, vocab, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, vocab)) * 3).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mine", [  # top_k's candidates, top_p's alone, and neither
    Sampling(temperature=0.8, top_p=0.9, top_k=50, seed=2**63 + 5),
    Sampling(top_p=0.8, seed=2**63 + 5), Sampling(temperature=1.3, min_p=0.02, seed=2**63 + 5)],
    ids=["top_k", "top_p", "min_p"])
def test_a_seeded_row_draws_the_same_alone_and_among_63_others(backend, mine):
    vocab, steps = 1000, 12
    my_logits = steps_of_logits(steps, 1, vocab, seed=3)
    neighbours = steps_of_logits(steps, 64, vocab, seed=4)
    alone = Rows(1)
    alone.add([mine])
    expected = [int(alone.sample(on(backend, x)).tokens[0]) for x in my_logits]

    others = [Sampling(), Sampling(temperature=0), Sampling(seed=17, min_p=0.1),
              Sampling(top_p=0.5, logprobs=3), Sampling(top_k=2, min_tokens=4, ignore_eos=True)]
    batch = Rows(64, eos_token_ids=[0, 1])
    batch.add([others[i % 5] for i in range(17)] + [mine] + [others[i % 5] for i in range(46)])
    at, got = 17, []
    for step in range(steps):
        if step == 5:  # neighbours leave and come: the seeded row's stream is its own
            batch.keep(np.arange(64) >= 9)
            batch.add([Sampling(seed=1)] * 9)
            at = 8
        x = neighbours[step].copy()
        x[at] = my_logits[step][0]
        got.append(int(batch.sample(on(backend, x)).tokens[at]))
    assert got == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_zero_is_exactly_the_argmax(backend):
    logits = steps_of_logits(1, 64, 5000, seed=4)[0]
    logits[3, 10:20] = logits[3].max() + 1  # a tie: the first
    rows = Rows(64)
    rows.add([Sampling(temperature=0.0, top_p=0.1, top_k=3, seed=9)] * 32
             + [Sampling(temperature=1e-6)] * 32)
    assert (rows.sample(on(backend, logits)).tokens == logits.argmax(axis=1)).all()


@NO_TORCH
def test_torch_logits_in_host_memory_of_any_float_dtype_are_read_as_they_are():
    import torch
    logits = torch.randn(3, 300, dtype=torch.bfloat16, requires_grad=True)
    rows = Rows(3)
    rows.add([Sampling(temperature=0, logprobs=1)] * 3)
    out = rows.sample(logits)
    assert out.tokens.tolist() == logits.float().argmax(dim=1).tolist()
    wide = torch.randn(3, 300, dtype=torch.float64)[:, ::2]  # strided, float64
    assert rows.sample(wide).tokens.tolist() == wide.argmax(dim=1).tolist()
    with pytest.raises(BadResult, match=r"expected float\[3, V\], got torch int64\[3, 300\]"):
        rows.sample(torch.zeros(3, 300, dtype=torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_tokens_masks_eos_and_stop_ids_until_reached(backend):
    eos, stop, vocab = 5, 9, 20
    logits = np.zeros((3, vocab), np.float32)
    logits[:, eos], logits[:, stop] = 60.0, 50.0  # any sampler picks eos, then the stop id
    rows = Rows(3, eos_token_ids=[eos, 10**6])  # an eos past the vocabulary masks nothing
    rows.add([Sampling(min_tokens=3, stop_token_ids=[stop, 10**6]),
              Sampling(min_tokens=3, temperature=0, stop_token_ids=[stop]),
              Sampling(stop_token_ids=[stop])])
    firsts = [rows.sample(on(backend, logits)).tokens for _ in range(3)]
    for tokens in firsts:
        assert tokens[0] not in (eos, stop) and tokens[1] not in (eos, stop)
        assert tokens[2] == eos and rows.stops(tokens).tolist() == [False, False, True]
    after = rows.sample(on(backend, logits)).tokens
    assert after.tolist() == [eos, eos, eos] and rows.stops(after).all()
    assert rows.stops(np.array([stop, 0, stop])).tolist() == [True, False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_eos_never_samples_eos_and_never_ends_on_it(backend):
    eos, vocab = 3, 8
    logits = np.zeros((2, vocab), np.float32)
    logits[:, eos] = 40.0
    rows = Rows(2, eos_token_ids=[eos])
    rows.add([Sampling(ignore_eos=True), Sampling(ignore_eos=True, temperature=0)])
    for _ in range(50):
        tokens = rows.sample(on(backend, logits)).tokens
        assert eos not in tokens.tolist()
    assert not rows.stops(np.array([eos, eos])).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_stay_ids_of_the_vocabulary_whatever_the_logits(backend):
    logits = np.zeros((4, 6), np.float32)
    logits[0] = np.nan
    logits[1, 4] = np.inf
    logits[2] = -np.inf
    rows = Rows(4, eos_token_ids=range(6))
    rows.add([Sampling(top_p=0.5, logprobs=2)] * 3 + [Sampling(ignore_eos=True)])  # all masked
    tokens = rows.sample(on(backend, logits)).tokens
    assert tokens.dtype == np.int64 and ((tokens >= 0) & (tokens < 6)).all()
    assert tokens[1] == 4


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(axis=1, keepdims=True) - np.log(
        np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["raw", "scaled"])
def test_logprobs_are_log_softmax_at_the_chosen_and_top_ids(backend, mode):
    vocab = 3000
    logits = steps_of_logits(1, 6, vocab, seed=5)[0]
    params = [Sampling(temperature=0.5, logprobs=4, top_k=20), Sampling(temperature=1.5, logprobs=2),
              Sampling(temperature=0, logprobs=1), Sampling(), Sampling(temperature=0.7, logprobs=20),
              Sampling(temperature=0.7, min_tokens=5, logprobs=3)]
    rows = Rows(6, eos_token_ids=[int(logits[5].argmax())], logprobs_mode=mode)
    rows.add(params)
    out = rows.sample(on(backend, logits.astype(np.float16)))
    x = logits.astype(np.float16).astype(np.float32)
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 20)
    for i, s in enumerate(params):
        if not s.logprobs:
            assert np.isnan(out.logprobs[i]) and (out.top_ids[i] == -1).all()
            continue
        t = 1.0 if mode == "raw" or s.greedy else s.temperature
        want = log_softmax(x[i:i + 1] / t)[0]
        assert out.logprobs[i] == pytest.approx(want[out.tokens[i]], abs=2e-5)
        k = s.logprobs
        assert out.top_ids[i, :k].tolist() == np.argsort(-want, kind="stable")[:k].tolist()
        np.testing.assert_allclose(out.top_logprobs[i, :k], want[out.top_ids[i, :k]], atol=2e-5)
        assert (out.top_ids[i, k:] == -1).all() and np.isnan(out.top_logprobs[i, k:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_logprobs_tied_at_the_last_place_are_the_smallest_ids(backend):
    logits = np.zeros((2, 3000), np.float32)
    logits[1, 2000] = 1.0
    rows = Rows(2)
    rows.add([Sampling(temperature=0, logprobs=5)] * 2)
    assert rows.sample(on(backend, logits)).top_ids.tolist() == [[0, 1, 2, 3, 4],
                                                                 [2000, 0, 1, 2, 3]]
    _, top_ids, _ = score(on(backend, logits), np.array([0, 0]), 3)
    assert top_ids.tolist() == [[0, 1, 2], [2000, 0, 1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_gives_a_prompts_logprobs(backend):
    logits = steps_of_logits(1, 5, 50, seed=6)[0]
    ids = np.array([3, 0, 49, 7, 7])
    chosen, top_ids, top = score(on(backend, logits), ids, 60)  # more than the vocabulary
    want = log_softmax(logits)
    np.testing.assert_allclose(chosen, want[np.arange(5), ids], atol=2e-5)
    assert top_ids.shape == (5, 60) and (top_ids[:, 50:] == -1).all()
    np.testing.assert_allclose(top[:, :50], np.sort(want, axis=1)[:, ::-1], atol=2e-5)
    alone, no_ids, _ = score(on(backend, logits), ids, 0)  # prompt_logprobs=0: the token's alone
    assert no_ids.shape == (5, 0) and (alone == chosen).all()
    hot, _, _ = score(on(backend, logits), ids, 1, temperature=0.5)
    np.testing.assert_allclose(hot, log_softmax(logits / 0.5)[np.arange(5), ids], atol=2e-5)
    with pytest.raises(ValueError, match="0..49"):
        score(on(backend, logits), np.array([0, 1, 2, 3, 50]), 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_that_are_not_float_n_by_v_are_a_bad_result(backend):
    rows = Rows(4)
    rows.add([Sampling()] * 2)
    for bad in (np.zeros((3, 8), np.float32), np.zeros(8, np.float32), np.zeros((2, 8), np.int64),
                np.zeros((2, 0), np.float32)):
        with pytest.raises(BadResult, match=r"expected float\[2, V\]"):
            rows.sample(on(backend, bad))
    with pytest.raises(BadResult, match="got list"):
        rows.sample([[0.0], [1.0]])


def test_logits_in_column_major_order_draw_what_row_major_ones_do():
    x = steps_of_logits(1, 64, 50_257, seed=6)[0]
    got = []
    for logits in (x, np.asfortranarray(x)):  # a transposed tensor's view, say
        rows = Rows(64, seed=7)
        rows.add([Sampling(top_p=0.9)] * 64)  # one kind of row: sampled through a view of x
        got.append([rows.sample(logits).tokens.tolist() for _ in range(10)])
    assert got[0] == got[1]


@pytest.mark.parametrize("kept", [0.002, 0.5, 1.0], ids=["few ids a row", "many", "every id"])
def test_candidates_are_each_rows_ids_at_or_above_its_threshold_in_id_order(kept):
    from engine.batching.sampler_numpy import gathered
    rng = np.random.default_rng(8)
    values = rng.random((9, 3001)).astype(np.float32)[:, ::2]  # strided, as a row subset is
    t = np.quantile(values, 1 - kept, axis=1).astype(np.float32)
    t[4] = np.nan  # a row that keeps nothing
    ids, got = gathered(values, t, np.float32(-1), 3)
    width = max(3, max(int((row >= cut).sum()) for row, cut in zip(values, t)))
    assert ids.shape == got.shape == (9, width)
    for row, cut, row_ids, row_got in zip(values, t, ids, got):
        want = np.flatnonzero(row >= cut)
        assert row_ids[:len(want)].tolist() == want.tolist() and (row_ids[len(want):] == -1).all()
        assert (row_got[:len(want)] == row[want]).all() and (row_got[len(want):] == -1).all()


def test_rows_keep_follows_the_batch_and_counts_each_rows_steps():
    rows = Rows(4, eos_token_ids=[0])
    rows.add([Sampling(min_tokens=1, temperature=0), Sampling(min_tokens=2, temperature=0)])
    logits = np.array([[9.0, 0.0, 1.0]] * 2, np.float32)
    assert rows.sample(logits).tokens.tolist() == [2, 2]  # eos masked for both
    rows.keep(np.array([False, True]))
    rows.add([Sampling(temperature=0)])
    assert rows.n == 2
    assert rows.sample(logits).tokens.tolist() == [2, 0]  # the kept row's 2nd; the new row free
    assert rows.sample(logits).tokens.tolist() == [0, 0]
    with pytest.raises(ValueError, match="cannot take 3 more"):
        rows.add([Sampling()] * 3)


# -- Sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expected", [
    ("temperature", -0.1, "a finite number >= 0"), ("temperature", math.inf, "finite"),
    ("temperature", "1", "finite number"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"), ("top_k", -2, "-1 or 0 (off)"), ("top_k", 2.0, "-1 or 0"),
    ("top_k", True, "-1 or 0"), ("min_p", 1.01, "[0, 1]"), ("seed", -1, "0..2**64-1"),
    ("seed", 2**64, "0..2**64-1"), ("min_tokens", -1, "0.."), ("ignore_eos", 1, "a bool"),
    ("stop_token_ids", "abc", "a sequence"),
    ("stop_token_ids", [1, -4], "[1]: expected a token id in 0..2147483647, got -4"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), f"at most {MAX_STOP_TOKEN_IDS}"),
    ("logprobs", 21, "0..20"), ("logprobs", None, "0..20"), ("prompt_logprobs", -1, "None or"),
])
def test_sampling_refuses_what_it_cannot_mean(field, value, expected):
    with pytest.raises(engine.InvalidInput) as e:
        Sampling(**{field: value})
    assert str(e.value).startswith(field) and expected in str(e.value)
    assert "got " in str(e.value)


def test_sampling_is_exported_canonical_frozen_and_checked_against_an_engine():
    assert engine.Sampling is Sampling and "Sampling" in engine.__all__
    s = Sampling(top_k=-1, temperature=1, stop_token_ids=[np.int64(4)])
    assert s.top_k == 0 and type(s.temperature) is float and s.stop_token_ids == (4,)
    assert s == Sampling(stop_token_ids=(4,)) and hash(s) == hash(Sampling(stop_token_ids=[4]))
    with pytest.raises(AttributeError):
        s.temperature = 0.5  # type: ignore[misc]
    assert Sampling(logprobs=5).check(max_logprobs=5) is not None
    with pytest.raises(engine.InvalidInput, match=r"logprobs: expected at most 2 \(the engine's"):
        Sampling(logprobs=3).check(max_logprobs=2)
    with pytest.raises(engine.InvalidInput, match="prompt_logprobs: expected at most 0"):
        Sampling(prompt_logprobs=1).check(max_logprobs=0)
    with pytest.raises(engine.InvalidInput, match=r"min_tokens: expected at most 8 .* got 9"):
        Sampling(min_tokens=9).check(max_logprobs=0, max_steps=8)


def test_a_record_reads_back_as_the_sampling_written():
    s = Sampling(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, seed=2**64 - 1, min_tokens=3,
                 ignore_eos=True, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), logprobs=20,
                 prompt_logprobs=0)
    assert RECORD_DTYPE.itemsize == RECORD_BYTES == len(s.encode())
    assert RECORD_DTYPE.fields["stop_token_ids"][1] == HEAD_BYTES <= 64  # the scalars
    assert Sampling.decode(s.encode()) == s and Sampling.decode(Sampling().encode()) == Sampling()
    region = np.zeros(4, RECORD_DTYPE)  # as a segment holds them, a record per slot
    region[2] = np.frombuffer(s.encode(), RECORD_DTYPE)[0]
    assert Sampling.decode(region[2]) == s and Sampling.decode(region[2]).seed == 2**64 - 1


@pytest.mark.parametrize("field, value, expected", [
    ("version", 0, "expected version 1, got 0"), ("flags", 0x80, "expected flags within 0x7"),
    ("n_stop", 200, "at most 32 stop ids, got 200"), ("temperature", np.nan, "temperature: exp"),
    ("top_p", 0.0, "top_p: expected"), ("top_k", 2**32 - 1, "top_k: expected"),
    ("min_tokens", 2**31, "min_tokens: expected"), ("logprobs", 255, "logprobs: expected"),
])
def test_a_scribbled_record_is_refused_saying_what_is_wrong(field, value, expected):
    good = np.frombuffer(Sampling(stop_token_ids=[1]).encode(), RECORD_DTYPE)
    record = good.copy()
    record[0][field] = value
    with pytest.raises(engine.InvalidInput, match="sampling record: .*" + expected.replace(
            "(", r"\(")):
        Sampling.decode(record[0])
    stops = good.copy()
    stops[0]["stop_token_ids"][0] = -5
    with pytest.raises(engine.InvalidInput, match=r"ids\[0\]: expected a token id .* got -5"):
        Sampling.decode(stops.tobytes())
    with pytest.raises(engine.InvalidInput, match=f"expected {RECORD_BYTES} bytes, got 3"):
        Sampling.decode(b"abc")

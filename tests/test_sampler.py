"""Sampling's checks and its record."""
import math

import numpy as np
import pytest

import engine
from engine.sampling import HEAD_BYTES, MAX_STOP_TOKEN_IDS, RECORD_BYTES, RECORD_DTYPE, Sampling


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

"""Sampling in the engine, end to end (engine.Sampling, batching.sampled_steps):
a step model of V = 50 whose logits the tests compute directly
(logit_models.logits_of), served with sampling=True across real processes.
"""
import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import unique_name, wait_until_no_slot_in_use
from logit_models import DONE_AT, EOS, FORCE_EOS, logits_of, prompt_logits

import engine
from engine.batching.sampler import Rows
from engine.client import sampled
from engine.config import EngineConfig

SPEC = dict(backend="logit_models:logits", input_shape=(None,), max_input_shape=(8,),
            input_dtype="int64", iterative=True, sampling=True, max_steps=12, max_batch_size=8,
            max_delay_ms=50.0, eos_token_ids=[EOS], max_logprobs=4)
GREEDY = engine.Sampling(temperature=0)


@pytest.fixture(scope="module")
def joins(tmp_path_factory):
    """The file the engine's model logs each join to (logit_models.Logits)."""
    return tmp_path_factory.mktemp("joins") / "joins.log"


@pytest.fixture(scope="module")
def eng(joins):
    e = engine.Engine(unique_name("sampling"), **SPEC, prompt_logprobs=True,
                      backend_args={"calls_log": str(joins)}).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(eng):
    with engine.Client(eng.name) as c:
        yield c


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def greedy_chain(prompt, n, masked=None):
    """The argmax chain computed directly; masked: {pos: ids set to -inf there}."""
    out = []
    for pos in range(n):
        x = logits_of(prompt, out).copy()
        x[list((masked or {}).get(pos, ()))] = -np.inf
        out.append(int(np.argmax(x)))
    return out


def alone(prompt, sampling, n):
    """The tokens of a request alone, drawn with the engine's own sampler."""
    rows = Rows(1, [EOS])
    rows.add([sampling])
    out = []
    for _ in range(n):
        s = rows.sample(logits_of(prompt, out)[None])
        out.append(int(s.tokens[0]))
        if rows.stops(s.tokens)[0]:
            break
    return out


def test_greedy_tokens_are_the_argmax_chain(client):
    prompt = np.array([3, 5, 7], np.int64)
    stream = client.stream(prompt, timeout=30, sampling=GREEDY)
    tokens = [int(t) for t in stream]
    expected = greedy_chain(prompt, 12)
    if EOS in expected:
        expected = expected[:expected.index(EOS) + 1]
    assert tokens == expected
    assert stream.finish_reason == ("stop" if expected[-1] == EOS else "length")
    # infer stacks the same tokens; a chunk without logprobs is the int64 token
    y = client.infer(prompt, timeout=30, sampling=GREEDY)
    assert y.dtype == np.int64 and y.tolist() == expected


def test_each_chunk_carries_its_logprobs_as_the_model_gives_them(client):
    prompt = np.array([11, 2], np.int64)
    s = engine.Sampling(temperature=0.8, seed=5, logprobs=3)
    chunks = list(client.stream(prompt, timeout=30, sampling=s, max_steps=8))
    assert chunks and all(set(c) == {"token", "logprob", "top_ids", "top_logprobs"}
                          for c in chunks)
    generated = []
    for c in chunks:
        expected = log_softmax(logits_of(prompt, generated))
        token = int(c["token"])
        assert c["top_ids"].shape == (3,) and c["top_ids"].dtype == np.int64
        assert c["top_logprobs"].dtype == np.float32
        assert np.isclose(c["logprob"], expected[token], atol=1e-4)
        assert c["top_ids"].tolist() == np.argsort(-expected, kind="stable")[:3].tolist()
        assert np.allclose(c["top_logprobs"], expected[c["top_ids"]], atol=1e-4)
        generated.append(token)
    # stacked per key by infer and submit
    y = client.submit(prompt, timeout=30, sampling=s, max_steps=8).result(timeout=30)
    assert y["token"].tolist() == generated and y["top_ids"].shape == (len(generated), 3)


_CHILD = """
import sys, numpy as np, engine
c = engine.Client(sys.argv[1])
target = engine.Sampling(temperature=1.0, top_p=0.9, seed=1234)
others = [engine.Sampling(temperature=1.3, seed=s if s % 2 else None) for s in range(7)]
futures = [c.submit(np.array([20 + i, 1 + i], np.int64), timeout=30, sampling=s)
           for i, s in enumerate(others[:4])]
mine = c.submit(np.array([9, 4, 1], np.int64), timeout=30, sampling=target)
futures += [c.submit(np.array([30 + i], np.int64), timeout=30, sampling=s)
            for i, s in enumerate(others[4:])]
[f.result() for f in futures]
print(" ".join(str(int(t)) for t in mine.result()))
"""


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_full_batch(eng):
    target = engine.Sampling(temperature=1.0, top_p=0.9, seed=1234)
    expected = alone([9, 4, 1], target, 12)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD, eng.name], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [int(t) for t in out.stdout.split()] == expected


def test_eos_ends_with_stop_unless_ignored_and_min_tokens_masks_it(client):
    prompt = np.array([FORCE_EOS, 3, 6], np.int64)
    stream = client.stream(prompt, timeout=30, sampling=GREEDY)
    tokens = [int(t) for t in stream]
    assert tokens == greedy_chain(prompt, 4) and tokens[-1] == EOS
    assert stream.finish_reason == "stop"
    stream = client.stream(prompt, timeout=30, max_steps=6,
                           sampling=engine.Sampling(temperature=0, ignore_eos=True))
    tokens = [int(t) for t in stream]
    assert tokens == greedy_chain(prompt, 6, {p: [EOS] for p in range(6)})
    assert EOS not in tokens and stream.finish_reason == "length"
    stream = client.stream(prompt, timeout=30, max_steps=6,
                           sampling=engine.Sampling(temperature=0, min_tokens=5))
    tokens = [int(t) for t in stream]
    expected = greedy_chain(prompt, 6, {p: [EOS] for p in range(5)})
    if EOS in expected:
        expected = expected[:expected.index(EOS) + 1]
    assert tokens == expected and EOS not in tokens[:5]


def test_stop_token_ids_end_the_request_with_stop_and_the_model_may_end_it(client):
    prompt = np.array([3, 5, 7], np.int64)
    chain = greedy_chain(prompt, 12)
    stop = next(t for t in chain[1:] if t != EOS)
    stream = client.stream(prompt, timeout=30,
                           sampling=engine.Sampling(temperature=0, stop_token_ids=[stop]))
    tokens = [int(t) for t in stream]
    assert tokens == chain[:chain.index(stop) + 1] and stream.finish_reason == "stop"
    # the model's done ends it too: its last chunk is the token sampled at that step
    prompt = np.array([DONE_AT, 2, 1], np.int64)
    stream = client.stream(prompt, timeout=30, sampling=engine.Sampling(temperature=0,
                                                                        ignore_eos=True))
    tokens = [int(t) for t in stream]
    assert len(tokens) == 3 and stream.finish_reason == "stop"


def test_a_scribbled_record_fails_its_request_alone(eng, client, monkeypatch):
    prompt = np.array([4, 4], np.int64)
    good = [client.submit(prompt, timeout=30, sampling=GREEDY) for _ in range(2)]
    real = sampled.record

    def scribbled(seg, sampling, max_steps):
        record, k = real(seg, sampling, max_steps)
        record = record.copy()
        record[40] = 7  # the version byte: no client writes it
        return record, k

    monkeypatch.setattr(sampled, "record", scribbled)
    bad = client.submit(prompt, timeout=30, sampling=GREEDY)
    monkeypatch.setattr(sampled, "record", real)
    good += [client.submit(prompt, timeout=30, sampling=GREEDY) for _ in range(2)]
    with pytest.raises(engine.EngineCorrupt, match="sampling record: expected version 1"):
        bad.result(timeout=30)
    expected = client.infer(prompt, timeout=30, sampling=GREEDY).tolist()
    assert all(f.result(timeout=30).tolist() == expected for f in good)
    assert wait_until_no_slot_in_use(eng)


def test_what_a_sampling_engine_refuses_at_the_client(client):
    prompt = np.array([1, 2], np.int64)
    with pytest.raises(engine.InvalidInput, match="logprobs: expected at most 4"):
        client.infer(prompt, timeout=30, sampling=engine.Sampling(logprobs=5))
    with pytest.raises(engine.InvalidInput, match="engine.Sampling or None"):
        client.infer(prompt, timeout=30, sampling={"temperature": 0})


def test_stream_async_and_infer_async_cut_chunks_to_the_request(client):
    prompt = np.array([3, 5, 7], np.int64)
    s = engine.Sampling(temperature=0, logprobs=1)

    async def main():
        chunks = [c async for c in client.stream_async(prompt, timeout=30, sampling=s)]
        return chunks, await client.infer_async(prompt, timeout=30, sampling=s)
    chunks, y = asyncio.run(main())
    assert [int(c["token"]) for c in chunks] == y["token"].tolist()
    assert y["top_ids"].shape == (len(chunks), 1) and y["top_ids"][:, 0].tolist() == \
        y["token"].tolist()


def test_sampling_on_an_engine_without_it_is_invalid_input(make_engine):
    eng = make_engine("nosampling", backend="step_models:scripted", input_shape=(4,),
                      input_dtype="int64", output_shape=(), output_dtype="int64",
                      iterative=True, max_steps=4)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match="does not sample"):
            c.infer(np.array([1, 2, 0, 0], np.int64), timeout=30, sampling=GREEDY)


def test_the_knobs_are_checked():
    base = dict(name="k", input_shape=(None,), max_input_shape=(8,), input_dtype="int64")
    with pytest.raises(ValueError, match="needs iterative=True"):
        EngineConfig(**base, sampling=True)
    with pytest.raises(ValueError, match="outputs are its own"):
        EngineConfig(**base, iterative=True, sampling=True, output_shape=(3,))
    with pytest.raises(ValueError, match="max_logprobs must be an int in 0..20"):
        EngineConfig(**base, iterative=True, sampling=True, max_logprobs=21)
    cfg = EngineConfig(**base, iterative=True, sampling=True, max_logprobs=0)
    assert [s.name for s in cfg.output_specs] == ["token", "logprob"]
    assert EngineConfig.from_json(cfg.to_json()) == cfg


def test_torch_logits_are_sampled_as_numpy_ones(make_engine):
    pytest.importorskip("torch")
    eng = make_engine("torchlogits", **{**SPEC, "backend_args": {"torch_logits": True}})
    prompt = np.array([3, 5, 7], np.int64)
    with engine.Client(eng.name) as c:
        y = c.infer(prompt, timeout=30, sampling=GREEDY, max_steps=6).tolist()
        assert y == alone(prompt, GREEDY, 6) == greedy_chain(prompt, len(y))
        s = engine.Sampling(temperature=0.9, seed=77)
        assert c.infer(prompt, timeout=30, sampling=s, max_steps=6).tolist() == \
            alone(prompt, s, 6)


def test_each_request_keeps_its_own_tokens_as_others_join_and_leave(client):
    """Requests of different lengths, some withdrawn after a chunk, join and
    leave one running batch: each seeded one's tokens are still its own."""
    asks = [(np.array([5 + i, i], np.int64), engine.Sampling(temperature=1.1, seed=100 + i),
             2 + i) for i in range(6)]
    withdrawn = [client.stream(np.array([40, 1], np.int64), timeout=30,
                               sampling=engine.Sampling(temperature=1.0)) for _ in range(2)]
    futures = [client.submit(p, timeout=30, sampling=s, max_steps=m) for p, s, m in asks]
    for stream in withdrawn:
        next(stream)
        stream.close()
    late = [client.submit(p, timeout=30, sampling=s, max_steps=m) for p, s, m in asks[:2]]
    for f, (p, s, m) in zip(futures + late, asks + asks[:2]):
        assert f.result(timeout=30).tolist() == alone(p, s, m)


_BULK_CHILD = """
import sys, numpy as np, engine
c = engine.Client(sys.argv[1])
xs = np.array([[9, 4, 1], [3, 5, 7], [11, 2, 6]], np.int64)
each = [engine.Sampling(temperature=1.0, top_p=0.9, seed=1234),
        engine.Sampling(temperature=0), engine.Sampling(temperature=0.7, seed=8, logprobs=2)]
for y in c.infer_many(xs, timeout=30, sampling=each, max_steps=6):
    print(" ".join(str(int(t)) for t in (y["token"] if isinstance(y, dict) else y)))
for y in c.infer_many(xs, timeout=30, sampling=engine.Sampling(temperature=0)):
    print(" ".join(str(int(t)) for t in y))
"""


def test_infer_many_writes_each_rows_sampling_from_another_process(eng, client):
    xs = [[9, 4, 1], [3, 5, 7], [11, 2, 6]]
    each = [engine.Sampling(temperature=1.0, top_p=0.9, seed=1234), GREEDY,
            engine.Sampling(temperature=0.7, seed=8, logprobs=2)]
    expected = [alone(x, s, 6) for x, s in zip(xs, each)] + [alone(x, GREEDY, 12) for x in xs]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _BULK_CHILD, eng.name], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [[int(t) for t in line.split()] for line in out.stdout.splitlines()] == expected
    # each row's answer is cut to its own logprobs, as infer() cuts it
    ys = client.infer_many(np.array(xs, np.int64), timeout=30, sampling=each, max_steps=6)
    assert isinstance(ys[0], np.ndarray) and set(ys[2]) == {"token", "logprob", "top_ids",
                                                          "top_logprobs"}
    assert ys[2]["top_ids"].shape == (len(expected[2]), 2)
    with pytest.raises(engine.InvalidInput, match=r"expected one per row \(3\), got 2"):
        client.infer_many(np.array(xs, np.int64), timeout=30, sampling=each[:2])
    with pytest.raises(engine.InvalidInput, match=r"sampling\[1\]: logprobs: expected at most 4"):
        client.infer_many(np.array(xs[:2], np.int64), timeout=30,
                          sampling=[GREEDY, engine.Sampling(logprobs=5)])
    assert wait_until_no_slot_in_use(eng)


def assert_prompt_logprobs(entries, prompt, k):
    """Each entry is log_softmax of the model's logits at the position before
    it, for the actual prompt token, with the top k there."""
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        expected = log_softmax(prompt_logits(prompt[:j]))
        logprob, top_ids, top = entries[j]
        assert np.isclose(logprob, expected[prompt[j]], atol=1e-4)
        assert top_ids.dtype == np.int64 and top_ids.tolist() == \
            np.argsort(-expected, kind="stable")[:k].tolist()
        assert top.dtype == np.float32 and np.allclose(top, expected[top_ids], atol=1e-4)


def test_prompt_logprobs_come_before_the_first_chunk_alone_and_in_a_batch(client):
    prompt = [3, 5, 7, 9, 2]
    s = engine.Sampling(temperature=0, prompt_logprobs=2)
    stream = client.stream(np.array(prompt, np.int64), timeout=30, sampling=s, max_steps=3)
    assert stream.prompt_logprobs is None
    first = next(stream)
    assert_prompt_logprobs(stream.prompt_logprobs, prompt, 2)
    assert [int(first)] + [int(t) for t in stream] == greedy_chain(prompt, 3)
    # beside running requests that did not ask, and joined with another that asked
    others = [client.submit(np.array([20 + i, 1], np.int64), timeout=30, sampling=GREEDY)
              for i in range(3)]
    asks = [([4, 1, 8], engine.Sampling(temperature=0.8, seed=3, prompt_logprobs=0, logprobs=1)),
            ([6, 6, 2, 9, 9, 1, 3], engine.Sampling(temperature=0, prompt_logprobs=4))]
    streams = [client.stream(np.array(p, np.int64), timeout=30, sampling=a) for p, a in asks]
    for stream, (p, a) in zip(streams, asks):
        chunks = list(stream)
        assert_prompt_logprobs(stream.prompt_logprobs, p, a.prompt_logprobs)
        tokens = [int(c["token"]) if isinstance(c, dict) else int(c) for c in chunks]
        assert tokens == alone(p, a, 12)
    assert all(len(f.result(timeout=30)) for f in others)


def test_a_request_not_asking_gets_none_and_join_is_not_asked_for_every_position(client,
                                                                                  joins):
    prompt = np.array([3, 5, 7], np.int64)
    before = joins.read_text().splitlines()
    stream = client.stream(prompt, timeout=30, sampling=GREEDY)
    assert len(list(stream)) and stream.prompt_logprobs is None
    y = client.infer(prompt, timeout=30, sampling=engine.Sampling(temperature=0, logprobs=1))
    after = joins.read_text().splitlines()[len(before):]
    assert [line.split()[0] for line in after] == ["last", "last"]
    # infer of one that asks: a dict, its chunks per key and its prompt's logprobs
    s = engine.Sampling(temperature=0, logprobs=1, prompt_logprobs=1)
    scored = client.infer(prompt, timeout=30, sampling=s)
    assert [line.split()[0] for line in joins.read_text().splitlines()[len(before) + 2:]] == \
        ["all"]
    assert scored["token"].tolist() == y["token"].tolist()
    assert np.array_equal(scored["top_ids"], y["top_ids"])
    assert_prompt_logprobs(scored["prompt_logprobs"], prompt.tolist(), 1)
    tokens = client.infer(prompt, timeout=30, sampling=engine.Sampling(temperature=0,
                                                                        prompt_logprobs=0))
    assert tokens["token"].tolist() == y["token"].tolist()


def test_prompt_logprobs_through_asyncio(client):
    prompt = [9, 4, 1, 1]
    s = engine.Sampling(temperature=0, prompt_logprobs=3)

    async def main():
        chunks = client.open_stream_async(np.array(prompt, np.int64), timeout=30, sampling=s)
        try:
            got = [int(c) async for c in chunks]
        finally:
            await chunks.aclose()
        return got, chunks.prompt_logprobs, await client.infer_async(
            np.array(prompt, np.int64), timeout=30, sampling=s)
    tokens, entries, y = asyncio.run(main())
    assert_prompt_logprobs(entries, prompt, 3)
    assert_prompt_logprobs(y["prompt_logprobs"], prompt, 3)
    assert y["token"].tolist() == tokens == greedy_chain(prompt, len(tokens))


def test_what_asks_for_prompt_logprobs_in_vain(client, make_engine):
    prompt = np.array([1, 2], np.int64)
    s = engine.Sampling(prompt_logprobs=1)
    with pytest.raises(engine.InvalidInput, match=r"submit\(\) does not return them"):
        client.submit(prompt, timeout=30, sampling=s)
    with pytest.raises(engine.InvalidInput, match=r"infer_many\(\) does not return them"):
        client.infer_many(np.stack([prompt, prompt]), timeout=30, sampling=s)
    with pytest.raises(engine.InvalidInput, match=r"prompt_logprobs: expected at most 4"):
        client.infer(prompt, timeout=30, sampling=engine.Sampling(prompt_logprobs=5))
    eng = make_engine("noprompt", **SPEC)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match="has prompt_logprobs=False"):
            c.infer(prompt, timeout=30, sampling=s)
    with pytest.raises(ValueError, match="prompt_logprobs=True needs sampling=True"):
        EngineConfig(name="k", input_shape=(None,), max_input_shape=(8,), input_dtype="int64",
                     iterative=True, prompt_logprobs=True)


def test_a_serve_config_of_a_sampling_engine_needs_no_outputs(tmp_path):
    import argparse
    from engine.cli import commands
    path = tmp_path / "sampling.toml"
    path.write_text('[engines.s]\nbackend = "logit_models:Logits"\niterative = true\n'
                    'sampling = true\ninput_shape = ["none"]\nmax_input_shape = [8]\n'
                    'input_dtype = "int64"\n')
    (settings,), _ = commands.serve_plan(argparse.Namespace(config=str(path), backend_arg=None))
    assert "output_shape" not in settings and settings["sampling"] is True
    model = {k: v for k, v in settings.items() if k not in ("backend", "backend_args")}
    assert [s.name for s in EngineConfig(**model).output_specs] == \
        ["token", "logprob", "top_ids", "top_logprobs"]  # the engine's own
    path.write_text('[engines.g]\nbackend = "logit_models:Logits"\niterative = true\n'
                    'input_shape = ["none"]\nmax_input_shape = [8]\ninput_dtype = "int64"\n')
    with pytest.raises(ValueError, match="missing key.*output_shape"):  # one without sampling
        commands.serve_plan(argparse.Namespace(config=str(path), backend_arg=None))

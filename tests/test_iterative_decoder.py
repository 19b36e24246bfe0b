"""The built-in decoder (engine.tools.decoder): its iterative `steps` backend
streams each prompt as if decoded alone and ends a request at eos or its
context while its batch mates go on; its one-shot `generate` backend
answers the same tokens, each row ending at its own budget or context.
"""
import numpy as np
from iterative_helpers import ints

import engine
from engine.tools.decoder import Decoder

TINY = dict(vocab=64, d_model=16, layers=1, heads=2, context=64, seed=3)
PROMPTS = [np.array(p, np.int64) for p in ([5], [1, 2, 3], [60, 7, 7, 9, 30, 2], [12, 40])]


def test_a_decoder_stream_equals_the_prompt_decoded_alone(make_engine):
    eng = make_engine("decoder", backend="engine.tools.decoder:steps", backend_args=TINY,
                      input_shape=(None,), max_input_shape=(12,), input_dtype="int64",
                      output_shape=(), output_dtype="int64", iterative=True, max_steps=10)
    model = Decoder(**TINY)
    with engine.Client(eng.name) as c:
        own = [None, 4, None, 7]
        streams = [c.stream(p, timeout=60, max_steps=m) for p, m in zip(PROMPTS, own)]
        for s, p, m in zip(streams, PROMPTS, own):  # decoded together, each as if alone
            assert ints(s) == model.generate_one(p, m or 10).tolist(), p
        assert np.array_equal(c.infer(PROMPTS[2], timeout=60), model.generate_one(PROMPTS[2], 10))


def test_the_one_shot_generate_backend_answers_as_the_decoder_alone(make_engine):
    eng = make_engine("generate", backend="engine.tools.decoder:generate",
                      backend_args={**TINY, "steps": 10},
                      inputs={"prompt": ("int64", (None,)), "max_new_tokens": ("int64", (1,))},
                      max_input_shapes={"prompt": (12,)}, outputs={"tokens": ("int64", (10,))},
                      max_batch_size=4)
    model = Decoder(**TINY)
    budgets = [10, 3, 6, 1]
    with engine.Client(eng.name) as c:
        futures = [c.submit({"prompt": p, "max_new_tokens": np.array([n], np.int64)}, timeout=60)
                   for p, n in zip(PROMPTS, budgets)]
        for f, p, n in zip(futures, PROMPTS, budgets):
            tokens = f.result(timeout=60)["tokens"]
            assert tokens[:n].tolist() == model.generate_one(p, n).tolist(), p
            assert (tokens[n:] == -1).all()


def test_a_decoder_request_ends_at_eos_or_its_context_and_its_batch_mates_go_on(make_engine):
    tiny = {**TINY, "context": 16}
    model = Decoder(**tiny)
    short, long = np.array([1, 2], np.int64), np.arange(20, 32, dtype=np.int64)
    alone_short, alone_long = model.generate_one(short, 10), model.generate_one(long, 5)
    eos = int(alone_short[7])  # short ends at its first eos, after long filled its context
    cut = alone_short.tolist().index(eos) + 1
    assert 5 < cut < 10 and eos not in alone_long.tolist()
    # max_delay_ms: the flush rule starts the two together (the batch fills at 2)
    eng = make_engine("decoder-ends", backend="engine.tools.decoder:steps",
                      backend_args={**tiny, "eos": eos}, input_shape=(None,),
                      max_input_shape=(12,), input_dtype="int64", output_shape=(),
                      output_dtype="int64", iterative=True, max_steps=10, max_batch_size=2,
                      max_delay_ms=60_000)
    with engine.Client(eng.name) as c:
        streams = [c.stream(short, timeout=60), c.stream(long, timeout=60)]
        # long (12 tokens) has room for 16 - 12 + 1 = 5: it ends there, short goes on
        assert ints(streams[1]) == alone_long.tolist()
        assert ints(streams[0]) == alone_short[:cut].tolist()


def test_the_one_shot_generate_backend_ends_each_row_at_its_own_budget_or_context(make_engine):
    tiny = {**TINY, "context": 16}
    model = Decoder(**tiny)
    long, short = np.arange(20, 32, dtype=np.int64), np.array([3], np.int64)
    # one batch: long's budget fits its context, and short runs on past it
    eng = make_engine("generate-ends", backend="engine.tools.decoder:generate",
                      backend_args={**tiny, "steps": 10},
                      inputs={"prompt": ("int64", (None,)), "max_new_tokens": ("int64", (1,))},
                      max_input_shapes={"prompt": (12,)}, outputs={"tokens": ("int64", (10,))},
                      max_batch_size=3, max_delay_ms=60_000, isolate_failures=False)
    with engine.Client(eng.name) as c:
        asks = [(long, 2), (short, 10), (long, 9)]  # the last: room for 5 only
        futures = [c.submit({"prompt": p, "max_new_tokens": np.array([n], np.int64)},
                            timeout=60) for p, n in asks]
        answers = [f.result(timeout=60)["tokens"].tolist() for f in futures]
    assert answers[0] == model.generate_one(long, 2).tolist() + [-1] * 8
    assert answers[1] == model.generate_one(short, 10).tolist()
    assert answers[2] == model.generate_one(long, 5).tolist() + [-1] * 5

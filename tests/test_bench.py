"""The benchmark's own logic on small fast runs (no timing is asserted)."""
import json

import numpy as np
import pytest

from engine.cli import commands
from engine.tools import bench, load, procs


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = load.poisson_offsets_ns(1000.0, 20000, seed=3)
    assert np.array_equal(a, load.poisson_offsets_ns(1000.0, 20000, seed=3))
    assert not np.array_equal(a, load.poisson_offsets_ns(1000.0, 20000, seed=4))
    assert (np.diff(a) >= 0).all()
    assert a[-1] / 1e9 == pytest.approx(20.0, rel=0.03)  # n / rate seconds
    gaps = np.diff(a) / 1e9
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: cv = 1


def test_requests_split_over_clients_add_up():
    assert load.split_requests(1600, 4) == [400] * 4
    assert load.split_requests(10, 3) == [4, 3, 3]


def test_percentiles_of_known_latencies():
    ns = np.arange(1, 101) * 1_000_000  # 1..100 ms
    p = load.percentiles_ms(ns)
    assert p["max"] == 100.0
    assert p["p50"] == pytest.approx(50.5)
    assert p["p99"] == pytest.approx(99.01)


def test_answer_check_catches_a_wrong_or_misrouted_answer():
    expect = load.expected_fn("engine.backends:synthetic")
    idx = load.sample_index((16,))
    x = np.full(16, load.tag_value(2, 7), np.float32)
    assert load.check_answer(x[idx], x * 2 + 1, expect, idx, (16,))
    other = np.full(16, load.tag_value(3, 7), np.float32)
    assert not load.check_answer(x[idx], other * 2 + 1, expect, idx, (16,))
    assert not load.check_answer(x[idx], (x * 2 + 1)[:8], expect, idx, (16,))
    big = np.arange(1 << 16, dtype=np.float32)
    sample = load.sample_index(big.shape)
    assert 0 in sample and (1 << 16) - 1 in sample and len(sample) < 100
    assert load.check_answer(big[sample], big * 2 + 1, expect, sample, big.shape)
    assert not load.check_answer(big[sample], big, expect, sample, big.shape)
    assert not load.check_answer(x[idx], (x * 2 + 1).astype(np.float64), expect, idx, (16,))
    check = load.AnswerCheck(big[sample], expect, sample, big.shape)
    assert check(big * 2 + 1) and not check(np.zeros_like(big))


def test_tags_are_distinct_and_exact_in_float32():
    tags = {load.tag_value(c, k) for c in range(8) for k in range(0, 1 << 19, 997)}
    assert len(tags) == 8 * len(range(0, 1 << 19, 997))
    assert all(float(np.float32(t)) == t and float(np.float32(2 * t + 1)) == 2 * t + 1 for t in tags)


def test_theoretical_capacity_is_the_seed_cost_model():
    assert load.theoretical_rps(1, 2.0, 100.0) == pytest.approx(476.19, rel=1e-3)
    assert load.theoretical_rps(32, 2.0, 100.0) == pytest.approx(6153.8, rel=1e-3)


def test_backend_args_read_as_toml_values():
    assert commands.key_values(["fixed_ms=1.0", "n=3", 'name="x"', "name2=x", "flag=true"]) == \
        {"fixed_ms": 1.0, "n": 3, "name": "x", "name2": "x", "flag": True}


def test_a_small_bench_run_writes_the_documented_json_and_a_plot(tmp_path):
    code = commands.main(["bench", "--backend", "engine.backends:identity", "--batch-sizes", "1,4",
                     "--clients", "2", "--rate", "400", "--requests", "80", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["max_batch_size"], r["max_delay_ms"]) for r in result["rows"]] == [(1, 0.0), (4, 0.0)]
    for row in result["rows"]:
        for key in ("max_batch_size", "max_delay_ms", "offered_rps", "achieved_rps", "requests",
                    "answered", "avg_batch", "p50_ms", "p99_ms", "max_queue_wait_ms",
                    "mean_service_ms"):
            assert key in row
        assert (row["requests"], row["answered"], row["wrong"]) == (80, 80, 0)
        # from the scheduled arrival >= from the actual send >= to the engine's batch end
        assert row["p50_ms"] >= row["p50_from_send_ms"] >= row["p50_send_to_batch_done_ms"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_baseline_rows_answer_every_request_correctly():
    offered = load.Load(backend="engine.backends:identity", backend_args={}, clients=2,
                        rate=400, requests=60)
    for system in procs.SYSTEMS[1:]:
        row = bench.run_row(4, 1.0, offered, system=system)
        assert (row["answered"], row["wrong"], row["lost"]) == (60, 0, 0)


def test_tune_fits_the_cost_model_and_recommends_within_the_slo():
    from engine.tools import tune
    service = {n: 2.0 + 0.1 * n for n in tune.batch_sizes(64)}  # the synthetic S(n), exact
    f_ms, c_ms = tune.fit(service)
    assert (f_ms, c_ms) == (pytest.approx(2.0), pytest.approx(0.1))
    rec = tune.recommend(service, slo_ms=20.0)
    n = rec["max_batch_size"]
    assert rec["fits_slo"] and 2 * service[n] + rec["margin_ms"] <= 20.0
    assert rec["delay_budget_ms"] == pytest.approx(20.0 - 2 * service[n] - rec["margin_ms"])
    assert n > 1  # batching pays with a 2 ms fixed cost


def test_tune_says_batching_pays_only_with_a_fixed_cost_above_a_round_trip():
    from engine.tools import tune
    sizes = tune.batch_sizes(64)
    assert tune.recommend({n: 2.0 + 0.1 * n for n in sizes}, 20.0)["batching_pays"]
    assert not tune.recommend({n: 0.045 * n for n in sizes}, 20.0)["batching_pays"]  # per row only


def test_tune_never_recommends_a_delay_that_lone_requests_would_wait_for_nothing():
    from engine.tools import tune
    service = {n: 2.0 + 0.1 * n for n in tune.batch_sizes(64)}
    for slo_ms in (5.0, 20.0, 200.0):
        assert tune.recommend(service, slo_ms)["max_delay_ms"] == 0.0
    assert not tune.recommend(service, slo_ms=3.0)["fits_slo"]


def test_tune_measures_the_synthetic_backend(tmp_path):
    code = commands.main(["tune", "--backend-arg", "fixed_ms=0.2", "--backend-arg", "per_item_us=20",
                     "--slo-ms", "10", "--max-batch", "8", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "tune.json").read_text())
    assert sorted(map(int, result["service_ms"])) == [1, 2, 4, 8]
    assert result["recommendation"]["max_batch_size"] in (1, 2, 4, 8)
    assert (tmp_path / "tune.png").exists()


def test_tune_takes_named_tensors_as_flags(capsys):
    code = commands.main(["tune", "--backend", "engine.backends:identity", "--slo-ms", "10",
                     "--max-batch", "4", "--inputs", '{"ids": ["int64", [null]], "x": ["float32", [3]]}',
                     "--max-input-shapes", '{"ids": [8]}', "--outputs", '{"y": ["float32", [2]]}'])
    assert code == 0
    assert "ids: int64[8], x: float32[3]" in capsys.readouterr().out


def test_tune_reads_the_backend_and_tensors_of_a_serve_config(tmp_path, capsys):
    config = tmp_path / "model.toml"
    config.write_text('name = "m"\nbackend = "engine.backends:identity"\ninput_shape = [5]\n'
                      'output_shape = [5]\nmax_batch_size = 8\n')
    assert commands.main(["tune", "--config", str(config), "--slo-ms", "10", "--max-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "engine.backends:identity" in out and "float32[5]" in out


def test_the_decoder_bench_writes_the_documented_rows_every_answer_checked(tmp_path):
    from engine.tools import decoder_bench
    tiny = {"vocab": 64, "d_model": 16, "layers": 1, "heads": 2, "context": 64}
    setup = decoder_bench.Setup(seconds=0.5, rates=(20.0,), max_batch_size=4, max_steps=8,
                                max_prompt=8, mean_prompt=3, mean_output=4, clients=1,
                                model=tiny, min_requests=8, cost_actives=(2,), cost_seconds=0.5)
    result = decoder_bench.run(setup, out_dir=str(tmp_path))
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert rows == result["rows"] and (tmp_path / "bench.png").stat().st_size > 0
    assert [r["mode"] for r in rows] == ["one-shot", "iterative"]
    for r in rows:
        assert {"mode", "offered_rps", "tokens_per_s", "ttft_ms", "chunk_ms", "e2e_ms",
                "requests", "answered", "wrong"} <= set(r)
        assert r["offered_rps"] == 20.0 and r["requests"] == r["answered"] == 10
        assert r["wrong"] == 0 and r["tokens_per_s"] > 0
        assert all(set(r[k]) == {"p50", "p99"} for k in ("ttft_ms", "chunk_ms", "e2e_ms"))
    [cost] = result["engine_cost"]
    assert cost["active"] == 2 and cost["steps"] > 0 and cost["model_ms"] > 0


def test_the_decoder_bench_counts_an_answer_that_differs_from_its_oracle_as_wrong():
    from engine.tools import decoder_bench
    results = [(0, 0, 5, 9, [1, 2], [7, 8, 9]), (1, 0, 4, 8, [2], [1, 2]),
               (2, 0, 0, 6, [], "RequestTimeout: late")]
    row = decoder_bench.summarize("iterative", 10.0, results, [[7, 8, 9], [1, 3], [4]],
                                  {"avg_batch_size": 2.0})
    assert (row["requests"], row["answered"], row["wrong"]) == (3, 2, 1)
    assert row["errors"] == ["RequestTimeout"] and row["tokens_per_s"] == pytest.approx(5 / 9e-9)

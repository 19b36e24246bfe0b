"""`shmbatch tune` on every kind of engine: a step model's running batch, a
one-shot engine's length buckets, and a fit whose fixed cost comes out below
zero. The tuner measures in the test's own process; no timing is asserted,
only that each recommendation follows from the figures it reports."""
import json

import pytest
import tune_models

from engine.cli import commands
from engine.tools import tune, tune_steps

STEPS = ["tune", "--backend", "tune_models:steps", "--iterative", "true", "--input-shape", "4",
         "--input-dtype", "int64", "--output-shape", "", "--output-dtype", "int64",
         "--max-batch", "8"]


def read_json(path):
    """tune.json with its tables' keys as the ints they were."""
    def ints(table):
        return {int(n): v for n, v in table.items()}
    result = json.loads((path / "tune.json").read_text())
    for key in ("service_ms", "step_ms", "join_ms"):
        if key in result:
            result[key] = ints(result[key])
    for bucket in (result.get("buckets") or {}).values():
        bucket["service_ms"] = ints(bucket["service_ms"])
    return result


def test_tune_of_an_iterative_engine_steps_running_batches_and_meets_the_objectives(
        tmp_path, capsys):
    code = commands.main([*STEPS, "--backend-arg", "length=3", "--tpot-ms", "50",
                          "--ttft-ms", "200", "--out", str(tmp_path)])
    assert code == 0
    model = tune_models.MADE[-1]
    assert not model.breaches and not model.chunks  # each joined, stepped until done, left
    assert set(model.step_sizes) == {1, 2, 4, 8}
    assert {(n, shape) for n, shape, _ in model.joined_shapes} == {(n, (n, 4)) for n in (1, 2, 4, 8)}
    result = read_json(tmp_path)
    steps, joins, rec = result["step_ms"], result["join_ms"], result["recommendation"]
    assert result["kind"] == "iterative" and sorted(steps) == sorted(joins) == [1, 2, 4, 8]
    meets = [n for n in steps if steps[n] + 5.0 <= 50.0 and joins[1] + 2 * steps[n] + 20.0 <= 200.0]
    assert rec["max_batch_size"] == max(meets) and rec["fits"]
    assert rec["max_delay_ms"] == 0.0
    out = capsys.readouterr().out
    assert f"max_batch_size={rec['max_batch_size']}" in out and "T(n)" in out
    assert (tmp_path / "tune.png").exists()


def test_tune_of_an_iterative_engine_says_what_stops_the_running_batch():
    steps = {n: 0.5 + 0.25 * n for n in (1, 2, 4, 8, 16, 32)}  # T(n) = 0.5 ms + n x 0.25 ms
    joins = {n: 3.0 * n for n in steps}
    by_tpot = tune_steps.recommend(steps, joins, tpot_ms=5.2)
    assert (by_tpot["max_batch_size"], by_tpot["limited_by"]) == (16, "tpot")
    assert by_tpot["fit_limit"] == 16  # (5.2 - 0.52 margin - 0.5) / 0.25
    by_ttft = tune_steps.recommend(steps, joins, tpot_ms=5.2, ttft_ms=8.0)
    assert (by_ttft["max_batch_size"], by_ttft["limited_by"]) == (4, "ttft")  # 3 + 2 T(n) + 0.8
    unmet = tune_steps.recommend(steps, joins, tpot_ms=0.8)
    assert (unmet["max_batch_size"], unmet["fits"], unmet["limited_by"]) == (1, False, "tpot")
    assert tune_steps.recommend(steps, joins, tpot_ms=100.0)["limited_by"] == "max_batch"


def test_tune_of_the_built_in_decoder_joins_prompts_of_a_variable_length(tmp_path):
    code = commands.main(["tune", "--backend", "engine.tools.decoder:steps", "--iterative", "true",
                          "--backend-arg", "vocab=64", "--backend-arg", "d_model=16",
                          "--backend-arg", "layers=1", "--backend-arg", "heads=2",
                          "--backend-arg", "context=64", "--input-shape", "none",
                          "--max-input-shape", "8", "--input-dtype", "int64",
                          "--output-shape", "", "--output-dtype", "int64", "--max-steps", "32",
                          "--tpot-ms", "1000", "--max-batch", "4", "--out", str(tmp_path)])
    assert code == 0
    result = read_json(tmp_path)
    assert sorted(result["step_ms"]) == [1, 2, 4]
    assert result["recommendation"]["max_batch_size"] == 4  # 1 s a token: any of them


def test_tune_reads_an_iterative_engine_from_its_serve_config(tmp_path, capsys):
    config = tmp_path / "model.toml"
    config.write_text('name = "m"\nbackend = "tune_models:steps"\niterative = true\n'
                      'max_steps = 2\ninput_shape = [4]\ninput_dtype = "int64"\n'
                      'output_shape = []\noutput_dtype = "int64"\n')
    assert commands.main(["tune", "--config", str(config), "--tpot-ms", "50",
                          "--max-batch", "2"]) == 0
    model = tune_models.MADE[-1]
    assert not model.breaches and not model.chunks
    assert "step model tune_models:steps" in capsys.readouterr().out


def test_an_iterative_engine_reads_slo_ms_as_the_time_per_output_token(capsys):
    assert commands.main([*STEPS, "--slo-ms", "50"]) == 0
    out = capsys.readouterr().out
    assert "reading --slo-ms 50 as the time per output token" in out and "TPOT 50 ms" in out


def test_a_step_model_tuned_as_a_one_shot_engine_is_told_to_say_iterative(capsys):
    args = [a for a in STEPS if a not in ("--iterative", "true")]
    assert commands.main([*args, "--slo-ms", "50"]) == 1
    assert "it is a step model (join, step, leave)" in capsys.readouterr().err


def test_the_objectives_of_one_kind_of_engine_are_refused_for_the_other(capsys):
    one_shot = ["tune", "--backend", "engine.backends:identity", "--max-batch", "2"]
    assert commands.main([*one_shot, "--tpot-ms", "5"]) == 1
    assert "--tpot-ms and --ttft-ms are an iterative engine's" in capsys.readouterr().err
    assert commands.main(one_shot) == 1
    assert "expected --slo-ms MS" in capsys.readouterr().err
    assert commands.main([*STEPS, "--ttft-ms", "50"]) == 1
    assert "expected --tpot-ms MS" in capsys.readouterr().err
    assert commands.main([*STEPS, "--tpot-ms", "-1"]) == 1
    assert "expected objectives > 0 ms" in capsys.readouterr().err


def test_tune_of_length_buckets_measures_each_padded_to_its_bound(tmp_path, capsys):
    log = tmp_path / "batches.jsonl"
    code = commands.main(["tune", "--backend", "shape_backends:logged_lengths",
                          "--backend-arg", f"log_path='{log}'", "--input-shape", "none",
                          "--max-input-shape", "64", "--output-shape", "", "--length-buckets",
                          "8,32", "--slo-ms", "100", "--max-batch", "4", "--out", str(tmp_path)])
    assert code == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert {width for _, width, _ in calls} == {8, 32, 64}  # the bound past the last is added
    assert all(real == [width] * rows for rows, width, real in calls)
    result = read_json(tmp_path)
    assert sorted(map(int, result["buckets"])) == [8, 32, 64]
    assert result["recommended_for_bucket"] == 64
    largest = result["buckets"]["64"]
    assert result["service_ms"] == largest["service_ms"] and sorted(result["service_ms"]) == [1, 2, 4]
    expected = tune.recommend(largest["service_ms"], 100.0)
    assert result["recommendation"]["max_batch_size"] == expected["max_batch_size"]
    assert "the recommendation is the largest bucket's (<= 64)" in capsys.readouterr().out


def test_a_negative_fixed_cost_is_reported_below_resolution_and_flagged(tmp_path, capsys):
    code = commands.main(["tune", "--backend", "tune_models:convex", "--input-shape", "4",
                          "--output-shape", "4", "--slo-ms", "100", "--max-batch", "8",
                          "--out", str(tmp_path)])
    assert code == 0
    fit = read_json(tmp_path)["fit"]
    assert fit["fixed_ms"] < 0 and fit["fixed_below_resolution"]  # the fit's own figure, kept
    out = capsys.readouterr().out
    assert (f"fixed cost F: below measurement resolution (fit gave {fit['fixed_ms']:.3f} ms; "
            f"the cost is all per row)") in out
    assert "F = -" not in out and "ms + n x" not in out


@pytest.mark.parametrize("fixed_ms, flagged", [(-0.03, True), (0.0, False), (2.0, False)])
def test_only_a_fixed_cost_below_zero_is_flagged(fixed_ms, flagged):
    assert tune.fit_record(fixed_ms, 0.1)["fixed_below_resolution"] is flagged
    assert ("below measurement resolution" in tune.fit_text(fixed_ms, 0.1)) is flagged


def test_tune_of_a_serve_config_of_one_engine_needs_no_engine_flag(tmp_path, capsys):
    config = tmp_path / "models.toml"
    config.write_text('http_port = 8000\n[engines.only]\nbackend = "tune_models:steps"\n'
                      'iterative = true\nmax_steps = 2\ninput_shape = [4]\ninput_dtype = "int64"\n'
                      'output_shape = []\noutput_dtype = "int64"\n')
    assert commands.main(["tune", "--config", str(config), "--tpot-ms", "50",
                          "--max-batch", "2"]) == 0
    assert "step model tune_models:steps" in capsys.readouterr().out


def test_tune_of_a_sampling_engine_feeds_its_model_the_argmax_of_its_logits(tmp_path, capsys):
    config = tmp_path / "models.toml"
    config.write_text('[engines.s]\nbackend = "tune_models:logits"\niterative = true\n'
                      'sampling = true\nmax_steps = 8\ninput_shape = ["none"]\n'
                      'max_input_shape = [4]\ninput_dtype = "int64"\n')
    assert commands.main(["tune", "--config", str(config), "--tpot-ms", "1000",
                          "--max-batch", "4"]) == 0
    model = tune_models.MADE[-1]
    assert isinstance(model, tune_models.Logits) and set(model.step_sizes) == {1, 2, 4}
    assert not model.wrong and not model.argmax  # each fed its argmax; every one left
    assert "fed its argmax (sampling)" in capsys.readouterr().out

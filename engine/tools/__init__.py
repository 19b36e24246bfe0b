"""Tooling beside the serving runtime. The runtime (engine.*) never imports
this package; the plots need the `bench` extra (matplotlib).

The benchmark, `shmbatch bench`: `bench` throughput and latency against
max_batch_size, `closed_loop` the engine's own overhead, `overload` goodput
past capacity, `baselines` what a Python user would write instead, `load`
what the benchmarks offer and how they check answers, `procs` their client
processes; `model_bench` a real ONNX model (`onnx_model` builds it),
`decoder_bench` and `decoder_http` a generative model served one-shot,
iteratively and over HTTP, `decoder` that model (a transformer decoder in
numpy, random weights from a seed: `engine.tools.decoder:steps`).

The tuner, `shmbatch tune`: `tune` a one-shot engine's max_batch_size and
max_delay_ms, `tune_steps` an iterative engine's. Deployment: `manifest`
Kubernetes objects from a serve config, `manifest_pod` what its pod needs,
`manifest_measure` the memory its processes take, measured (`--measure`),
`manifest_keda` its KEDA ScaledObject, `manifest_kserve` a KServe
ServingRuntime, `manifest_yaml` their YAML text;
`dashboard` a Grafana dashboard of the engine's metrics.
"""


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib, which the 'bench' extra installs: "
                           "pip install 'shmbatch[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt

"""Tooling beside the serving runtime: the benchmark (`shmbatch bench`), the
multiprocessing baselines it compares with, and the tuner (`shmbatch tune`).
The runtime (engine.*) never imports this package; the plots need the
`bench` extra (matplotlib)."""


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

"""A backend that writes to the log, and warns, as it loads (tests/test_log_format.py)."""
import logging
import warnings


def chatty(scale: float = 2.0, offset: float = 1.0):
    log = logging.getLogger("model")  # a backend's own logger, not shmbatch's
    log.info("loading weights", extra={"weights": "w.bin", "scale": scale})
    try:
        raise OSError("no GPU found")
    except OSError:
        log.exception("falling back to the CPU")
    warnings.warn("an old weights format", UserWarning)
    return lambda batch: batch * scale + offset

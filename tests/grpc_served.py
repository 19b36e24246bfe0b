"""`shmbatch serve --http-port 0 --grpc-port 0` for the gRPC tests, and the engine
figures they read: every wait bounded, every answer checked against its request."""
import re

import numpy as np

from test_multi_engine import Served, table, top


AFFINE = dict(backend="helpers:affine", input_shape=[4], output_shape=[4], max_batch_size=8)
STEPS = dict(input_shape=[2], input_dtype="int64", output_shape=[], output_dtype="int64")


def affine(x: np.ndarray) -> np.ndarray:
    return x * 2 + 1  # tests/helpers.py:affine


class GrpcServed(Served):
    """A serve of the tables given (each (name, keys)), with HTTP and gRPC;
    `grpc` is the gRPC address its ready line names."""

    def __init__(self, folder, tables, **serve_keys):
        config = top(**serve_keys) + "".join(table(name, **keys) for name, keys in tables)
        super().__init__(folder, config, "--http-port", "0", "--grpc-port", "0")
        found = re.search(r" and gRPC (\S+)$", self.ready_line.strip())
        assert found, self.ready_line
        self.grpc = found.group(1)

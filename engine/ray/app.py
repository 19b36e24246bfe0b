"""deployment(): a Ray Serve application whose replicas share one engine per node."""
from typing import Any, Optional

from ray import serve

from engine.http.engines import DEFAULT_TIMEOUT_S
from engine.http.oip.request import spec_of
from engine.ray.replica import Replica
from engine.serving.supervisor import Engine


def deployment(name: str, engine: dict, num_replicas: Optional[Any] = None, *,
               timeout_s: float = DEFAULT_TIMEOUT_S, **serve_options: Any):
    """A Ray Serve application (a bound deployment) named `name`, for
    serve.run. `engine`: engine.Engine's keyword arguments, but its name (each
    node's engine is named after the application and the node). `timeout_s`:
    a request's timeout, unless an infer body's `timeout` parameter or
    infer()'s says otherwise. Serve's deployment options (ray_actor_options,
    autoscaling_config, max_ongoing_requests, max_replicas_per_node, ...)
    pass through. The engine's settings are checked here: TypeError or
    ValueError before anything is deployed."""
    knobs = dict(engine)
    if "name" in knobs:
        raise TypeError(f"engine: expected no 'name' (each node's engine is named after the "
                        f"application and its node), got {knobs['name']!r}")
    if not timeout_s > 0:
        raise ValueError(f"expected timeout_s > 0, got {timeout_s!r}")
    spec_of(name, Engine("check", **knobs).config)  # a tensor without a protocol datatype: ValueError
    if num_replicas is not None:
        serve_options["num_replicas"] = num_replicas
    return serve.deployment(Replica, name=name, **serve_options).bind(name, knobs, timeout_s)

"""shmbatch on Ray Serve: the replicas of a node share one engine.

    from ray import serve
    from engine.ray import deployment
    app = deployment("digits", engine={...}, num_replicas=4)
    serve.run(app, name="digits", route_prefix="/digits")

On each node that runs replicas of the application, one engine (one
supervisor process, its batchers) serves every replica of that node: its
batches mix their requests. The node's owner actor (engine.ray.owner)
starts it with the node's first replica, restarts it if it dies, and stops
it with the node's last. Each replica (engine.ray.replica) is a Client of
it, and reports its queue wait to Serve's autoscaler (engine.ray.scaling).
`engine.ray.node_engine` runs a node's engine as a process of its own; `engine.ray.app`
makes the application (deployment()).
"""
from typing import Any

__all__ = ["deployment", "engine_name", "QueueWaitPolicy"]


def __getattr__(name: str) -> Any:
    # lazily: a node's engine process (engine.ray.node_engine) needs none of Ray
    if name == "deployment":
        from engine.ray.app import deployment
        return deployment
    if name == "engine_name":
        from engine.ray.replica import engine_name
        return engine_name
    if name == "QueueWaitPolicy":
        from engine.ray.scaling import QueueWaitPolicy
        return QueueWaitPolicy
    raise AttributeError(f"module 'engine.ray' has no attribute {name!r}")

"""Client.infer() with its span (engine.client.tracing), when a tracer
provider is set: the wait leaves the answer in its slot, and one take then
copies it out with the engine's stamps."""
from typing import Any, Optional

from engine.client import answers, tracing, waiting
from engine.shm import codes, ring


def infer(client: Any, parent: Any, x: Any, timeout: Optional[float], priority: int,
          max_steps: Optional[int], out: Any) -> Any:
    """client.infer(x, ...) recorded under parent (tracing.context()'s).
    With Client(retries=N) the span covers every attempt, without stamps."""
    began = (parent, ring.now_ns())
    stamps, error = None, None
    try:
        retry = client._retry  # Client(retries=N)'s policy, None without
        if retry is not None:
            return retry.infer(client, x, timeout, priority, max_steps, out)
        deadline = waiting.deadline_ns(timeout)
        seg, slot, gen, outs = client._enqueue(x, deadline, priority, max_steps, out)
        client.await_answer(seg, slot, gen, deadline, timeout, outs, take=False)
        code, stamps, outputs = answers.take(seg, slot, gen, outs)
        if code != codes.OK:  # answered and ours: only a corrupt slot gets here
            stamps = None
            raise waiting.failed(seg, slot, gen, code)
        return seg.config.answer(outputs)
    except BaseException as e:
        error = e
        raise
    finally:
        tracing.record(began, client.name, stamps, error)

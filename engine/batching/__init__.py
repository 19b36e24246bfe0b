"""The batcher process: gather requests, call the model once, scatter answers.

`batcher` runs a one-shot engine (one call answers each request) and
`iterative` an iterative one (one step per call, a chunk per running request).
Both share `loop` (the wait for work and the loop's constants) and
`model_call` (one call of the model, and what its result must be). `joining`
admits new requests into an iterative engine's running batch, `threads`
bounds the model's own thread pools. `policy` says when to flush and whom to
take, `admission` fits the service time that clients predict waits from,
`aimd` adapts the batch limit to a latency objective, `warmup` calls the
model at every batch shape before the batcher says it is ready. `sampler`
picks each running request's next token from the model's logits (on numpy
by `sampler_numpy`; its torch path, `sampler_torch`, loads only for torch
logits); `sampled_steps` is the
iterative loop of an engine with sampling=True, which calls it.
"""

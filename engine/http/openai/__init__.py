"""The OpenAI API (/v1/) for the engines that have an [engines.NAME.openai] table.

`routes` the /v1/ routes over the front's engines; `settings` an engine's
openai table, checked against its tensors; `fields` a request's fields read
against the engine that serves its model; `honoured` which fields that would
change an answer its engine honours, the rest refused; `sampled` a
request's engine.Sampling on an engine that samples; `logprobs` a choice's
logprobs in OpenAI's shapes; `tokenizing` a caller's text made token ids
at a bounded cost, off the event loop when long; `text` the tokenizer hook,
incremental decoding, stop strings; `replies` answers and errors in
OpenAI's shape; `generate` completions and chat completions on iterative
engines; `several` those of several prompts or choices; `embeddings`
embeddings on one-shot engines; `rerank` a query's documents scored by a
one-shot reranker.
"""

"""The HTTP front: the Open Inference Protocol over the engine's clients.

`openinference` is the ASGI app, `oip_tensors` the tensor coding (JSON and
binary), `oip_request` an infer read against its engine (and the body limits
derived from it), `oip_body` bodies under their limit and the 413, `parsing`
large bodies parsed off the event loop (the parser process), `oip_generate`
the generate extension for iterative engines, `connections` what a connection
may cost (read timeout, cap, drain refusals, a bounded log), and `workers`
the uvicorn worker processes that `shmbatch serve --http-port` runs.
"""

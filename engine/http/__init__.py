"""The HTTP front: the Open Inference Protocol over the engine's clients.

`openinference` is the ASGI app, `oip_tensors` the tensor coding (JSON and
binary), `oip_generate` the generate extension for iterative engines, and
`workers` the uvicorn worker processes that `shmbatch serve --http-port` runs.
"""

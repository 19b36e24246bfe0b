"""The Open Inference Protocol over gRPC: Triton's `inference.GRPCInferenceService`.

Served by each HTTP worker of `serve --grpc-port` beside its HTTP routes, on
the same event loop and Engines (`shmbatch[grpc]`: grpcio, protobuf), for
tritonclient.grpc (sync, aio, streaming) and KServe's InferenceGRPCClient.
The HTTP front's rules, shared, not copied: its tensor checks and error
texts (engine.http.oip.request, engine.http.oip.tensors) as gRPC status
codes, its readiness, its limits.

`server` the grpc.aio server of one worker, its limits and drain; `service`
the unary RPCs (health, metadata, configuration, statistics, ModelInfer);
`streaming` ModelStreamInfer, an iterative engine's chunks as they come;
`messages` ModelInferRequest and ModelInferResponse as an engine's arrays;
`status` each refusal's status code; `regenerate` the script that builds
`generated` (protoc's modules, never edited by hand) from the protos vendored
in proto/ (Triton's, BSD-3-Clause: proto/LICENSE, proto/SOURCE).
"""

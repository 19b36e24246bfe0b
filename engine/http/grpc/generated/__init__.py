"""protoc's modules of Triton's protos (engine/http/grpc/proto/), never edited by hand.

`grpc_service_pb2` the service's messages, `grpc_service_pb2_grpc` its stub
and servicer, `model_config_pb2` the model configuration's messages: all
written by engine.http.grpc.regenerate (grpcio-tools 1.63.2: protobuf
gencode 5.26.1, which any runtime >= 5.26.1 reads). tritonclient.grpc
registers the same proto files in protobuf's default pool: both in one
process must be built from the same revision of them.
"""

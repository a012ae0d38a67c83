"""The generated message classes and service stubs under short names:

from producer_api.grpc.stubs import inference_pb2, inference_pb2_grpc
"""

from producer_api.grpc.proto.inferq.v1 import inference_pb2, inference_pb2_grpc

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name

__all__ = ["SERVICE_NAME", "inference_pb2", "inference_pb2_grpc"]

"""The gRPC server's settings: the API's (same `INFERQ_*` variables, same keys, limits and Redis)
plus its port. Importing this module does not import grpc."""

from __future__ import annotations

from pydantic import Field

from producer_api.settings import ApiSettings

DEFAULT_GRPC_PORT = 50051


class GrpcSettings(ApiSettings):
    """`inferq grpc` and the gRPC server of `inferq up`; every API setting applies as well."""

    grpc_port: int = Field(
        DEFAULT_GRPC_PORT, ge=0, le=65535, description="port the gRPC server listens on"
    )

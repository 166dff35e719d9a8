"""The gRPC health service's own service names (``SIDECAR_GRPC_PORT``), apart from the service
so that what names them (``health-sidecar probes --grpc``) never loads grpcio."""

READINESS = "readiness"  # as /health
LIVENESS = "liveness"  # as /live

"""The fronts: the gRPC service and HTTP/OpenAI server, request validation, the gateway that turns requests into streams, and the Prometheus metrics."""

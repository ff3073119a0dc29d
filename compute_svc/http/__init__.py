"""The OpenAI-compatible HTTP front door over the same scheduler as gRPC."""

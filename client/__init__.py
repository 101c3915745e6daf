"""The Python client of the coordinator's gRPC API; it needs only grpcio and the generated protos (no torch)."""
from client.client import AsyncClient, AsyncGeneration, Client, Completion, Generation, SpecPipeError, Stats

__all__ = ["AsyncClient", "AsyncGeneration", "Client", "Completion", "Generation", "SpecPipeError", "Stats"]

"""duospec client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for a `duospec serve` server.

    import duospec
    with duospec.Client("127.0.0.1:50051", api_key="...") as client:
        print(client.generate("def fib(n):", max_new_tokens=64).text)

Errors are typed (`duospec.sdk.NotFound`, ...; all subclass `DuospecError`). UNAVAILABLE is retried
with backoff; a generation whose stream breaks after its first chunk is resumed from the tokens it
delivered (exact for greedy and seeded requests; duospec/sdk/resume.py).
"""

from duospec.sdk.aio import AsyncClient, AsyncGenerationStream
from duospec.sdk.client import Client, GenerationStream
from duospec.sdk.errors import (
    Cancelled,
    DeadlineExceeded,
    DuospecError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from duospec.sdk.types import (
    GenerationChunk, GenerationResult, ModelCard, ReplicaStatus, SpeculationStats, TokenLogprob, Usage,
)

__all__ = [
    "AsyncClient", "AsyncGenerationStream", "Cancelled", "Client", "DeadlineExceeded", "DuospecError",
    "GenerationChunk", "GenerationResult", "GenerationStream", "InvalidArgument", "ModelCard", "NotFound",
    "PermissionDenied", "ReplicaStatus", "ResourceExhausted", "SpeculationStats", "TokenLogprob", "Unauthenticated", "Unavailable",
    "Usage",
]

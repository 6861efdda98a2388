"""duospec: speculative decoding split across machines (PEARL-style draft/target overlap).

The SDK names (`Client`, `AsyncClient`, errors) are imported lazily so that `import duospec`
stays cheap for workers that only need the engine.
"""

__version__ = "0.1.0"

_SDK_NAMES = (
    "Client", "AsyncClient", "GenerationResult", "GenerationChunk", "ModelCard", "DuospecError",
    "InvalidArgument", "Unauthenticated", "PermissionDenied", "NotFound", "ResourceExhausted",
    "DeadlineExceeded", "Unavailable", "Cancelled", "TokenLogprob",
)
_LAZY = {name: "duospec.sdk" for name in _SDK_NAMES}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'duospec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

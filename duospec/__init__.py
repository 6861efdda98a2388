"""duospec: speculative decoding split across machines (PEARL-style draft/target overlap).

The SDK names (`Client`, `AsyncClient`, errors) are imported lazily so that `import duospec`
stays cheap for workers that only need the engine.
"""

import os as _os

__version__ = "0.1.0"

# The pipeline's stages live in the repo's top-level folders (coordinator/, cluster/, draft_worker/,
# target_worker/) and install as duospec.coordinator, duospec.cluster, ... (pyproject's package-dir).
# In a source checkout those folders sit beside this package: let `duospec.coordinator` find them.
_CHECKOUT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_CHECKOUT, "coordinator", "__init__.py")) and _CHECKOUT not in __path__:
    __path__.append(_CHECKOUT)

_SDK_NAMES = (
    "Client", "AsyncClient", "GenerationResult", "GenerationChunk", "ModelCard", "ReplicaStatus", "DuospecError",
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

"""Constrained decoding (JSON schema, regex, Lark grammars), exact under speculation.

- `constraint.py`: what a request asks for (`Constraint`), as plain data.
- `backend.py`: our interface: a `GrammarBackend` compiles a constraint into a `Grammar`, whose
  `Matcher` follows one sequence (accept / validate / rollback / fill_bitmask / is_terminated / fork).
- `llguidance_backend.py`: the one implementation, on llguidance.
- `manager.py`: the compile cache (time-limited, off the event loop) and the target's per-sequence
  authoritative matchers that fill each verify row's mask.
- `tools.py`: OpenAI tools / tool_choice as constraints, and parsing tool calls out of the text.

The verify rule never sees a grammar: the target masks the logits of each verify row (p = 0 outside
the mask) before temperature, top-k/top-p and the accept test, so the standard rule keeps the output
the masked target's own (DESIGN §4, "Constrained requests").
"""

from duospec.structured.backend import GrammarBackend, Grammar, Matcher, apply_bitmask
from duospec.structured.constraint import Constraint, ConstraintError, ConstraintKind
from duospec.structured.manager import GrammarCompiler, GrammarStateError, ItemMasks, SequenceGrammars

__all__ = ["Constraint", "ConstraintError", "ConstraintKind", "Grammar", "GrammarBackend", "GrammarCompiler",
           "GrammarStateError", "ItemMasks", "Matcher", "SequenceGrammars", "apply_bitmask"]

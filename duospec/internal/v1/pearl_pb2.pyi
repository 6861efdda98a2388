from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftCommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_COMMAND_KIND_UNSPECIFIED: _ClassVar[DraftCommandKind]
    DRAFT_COMMAND_KIND_START: _ClassVar[DraftCommandKind]
    DRAFT_COMMAND_KIND_RESET: _ClassVar[DraftCommandKind]
    DRAFT_COMMAND_KIND_ADVANCE: _ClassVar[DraftCommandKind]
    DRAFT_COMMAND_KIND_RELEASE: _ClassVar[DraftCommandKind]
    DRAFT_COMMAND_KIND_FEATURES: _ClassVar[DraftCommandKind]

class DraftOutlook(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_OUTLOOK_UNSPECIFIED: _ClassVar[DraftOutlook]
    DRAFT_OUTLOOK_MORE: _ClassVar[DraftOutlook]
    DRAFT_OUTLOOK_EXHAUSTED: _ClassVar[DraftOutlook]

class BonusPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BONUS_POLICY_UNSPECIFIED: _ClassVar[BonusPolicy]
    BONUS_POLICY_SAMPLE: _ClassVar[BonusPolicy]
    BONUS_POLICY_SKIP: _ClassVar[BonusPolicy]

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_OBJECT: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]

class NextTokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_TOKEN_KIND_UNSPECIFIED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_RECOVERED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_BONUS: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_NONE: _ClassVar[NextTokenKind]

class VerifyErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_ERROR_KIND_UNSPECIFIED: _ClassVar[VerifyErrorKind]
    VERIFY_ERROR_KIND_SLOTS_EXHAUSTED: _ClassVar[VerifyErrorKind]
    VERIFY_ERROR_KIND_CONTEXT_OVERFLOW: _ClassVar[VerifyErrorKind]
    VERIFY_ERROR_KIND_BAD_REQUEST: _ClassVar[VerifyErrorKind]
    VERIFY_ERROR_KIND_KV_CACHE_FULL: _ClassVar[VerifyErrorKind]
    VERIFY_ERROR_KIND_GRAMMAR: _ClassVar[VerifyErrorKind]
DRAFT_COMMAND_KIND_UNSPECIFIED: DraftCommandKind
DRAFT_COMMAND_KIND_START: DraftCommandKind
DRAFT_COMMAND_KIND_RESET: DraftCommandKind
DRAFT_COMMAND_KIND_ADVANCE: DraftCommandKind
DRAFT_COMMAND_KIND_RELEASE: DraftCommandKind
DRAFT_COMMAND_KIND_FEATURES: DraftCommandKind
DRAFT_OUTLOOK_UNSPECIFIED: DraftOutlook
DRAFT_OUTLOOK_MORE: DraftOutlook
DRAFT_OUTLOOK_EXHAUSTED: DraftOutlook
BONUS_POLICY_UNSPECIFIED: BonusPolicy
BONUS_POLICY_SAMPLE: BonusPolicy
BONUS_POLICY_SKIP: BonusPolicy
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_JSON_OBJECT: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
NEXT_TOKEN_KIND_UNSPECIFIED: NextTokenKind
NEXT_TOKEN_KIND_RECOVERED: NextTokenKind
NEXT_TOKEN_KIND_BONUS: NextTokenKind
NEXT_TOKEN_KIND_NONE: NextTokenKind
VERIFY_ERROR_KIND_UNSPECIFIED: VerifyErrorKind
VERIFY_ERROR_KIND_SLOTS_EXHAUSTED: VerifyErrorKind
VERIFY_ERROR_KIND_CONTEXT_OVERFLOW: VerifyErrorKind
VERIFY_ERROR_KIND_BAD_REQUEST: VerifyErrorKind
VERIFY_ERROR_KIND_KV_CACHE_FULL: VerifyErrorKind
VERIFY_ERROR_KIND_GRAMMAR: VerifyErrorKind

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DraftCommand(_message.Message):
    __slots__ = ("seq_id", "epoch", "kind", "start_pos", "tail", "draft_until", "sampling", "pool", "committed_len", "max_hedges", "adopt", "features", "cache_salt", "constraint")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UNTIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_HEDGES_FIELD_NUMBER: _ClassVar[int]
    ADOPT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    epoch: int
    kind: DraftCommandKind
    start_pos: int
    tail: _containers.RepeatedScalarFieldContainer[int]
    draft_until: int
    sampling: Sampling
    pool: str
    committed_len: int
    max_hedges: int
    adopt: HedgeKey
    features: Features
    cache_salt: str
    constraint: GrammarConstraint
    def __init__(self, seq_id: _Optional[int] = ..., epoch: _Optional[int] = ..., kind: _Optional[_Union[DraftCommandKind, str]] = ..., start_pos: _Optional[int] = ..., tail: _Optional[_Iterable[int]] = ..., draft_until: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., pool: _Optional[str] = ..., committed_len: _Optional[int] = ..., max_hedges: _Optional[int] = ..., adopt: _Optional[_Union[HedgeKey, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., cache_salt: _Optional[str] = ..., constraint: _Optional[_Union[GrammarConstraint, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start_pos", "hidden_size", "fp16")
    START_POS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FP16_FIELD_NUMBER: _ClassVar[int]
    start_pos: int
    hidden_size: int
    fp16: bytes
    def __init__(self, start_pos: _Optional[int] = ..., hidden_size: _Optional[int] = ..., fp16: _Optional[bytes] = ...) -> None: ...

class HedgeKey(_message.Message):
    __slots__ = ("pos", "token")
    POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    pos: int
    token: int
    def __init__(self, pos: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class DraftControl(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[DraftCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[DraftCommand, _Mapping]]] = ...) -> None: ...

class DraftChunk(_message.Message):
    __slots__ = ("seq_id", "epoch", "start_pos", "tokens", "draft_probs", "outlook", "hedge", "alternatives", "forced")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    OUTLOOK_FIELD_NUMBER: _ClassVar[int]
    HEDGE_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    epoch: int
    start_pos: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[bytes]
    outlook: DraftOutlook
    hedge: HedgeKey
    alternatives: _containers.RepeatedScalarFieldContainer[int]
    forced: bool
    def __init__(self, seq_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start_pos: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[bytes]] = ..., outlook: _Optional[_Union[DraftOutlook, str]] = ..., hedge: _Optional[_Union[HedgeKey, _Mapping]] = ..., alternatives: _Optional[_Iterable[int]] = ..., forced: _Optional[bool] = ...) -> None: ...

class DraftChunkBatch(_message.Message):
    __slots__ = ("chunks", "busy_seconds", "idle_seconds", "failed_seq_ids", "kv", "grammar")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[DraftChunk]
    busy_seconds: float
    idle_seconds: float
    failed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: KVUsage
    grammar: GrammarWork
    def __init__(self, chunks: _Optional[_Iterable[_Union[DraftChunk, _Mapping]]] = ..., busy_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., failed_seq_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., grammar: _Optional[_Union[GrammarWork, _Mapping]] = ...) -> None: ...

class GrammarWork(_message.Message):
    __slots__ = ("mask_seconds", "mask_rows", "forced_tokens")
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mask_seconds: float
    mask_rows: int
    forced_tokens: int
    def __init__(self, mask_seconds: _Optional[float] = ..., mask_rows: _Optional[int] = ..., forced_tokens: _Optional[int] = ...) -> None: ...

class KVUsage(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "prefix_cache_queries", "prefix_cache_hits", "block_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    block_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("seq_id", "epoch", "start_pos", "context", "draft_tokens", "draft_probs", "sampling", "bonus", "draft_parents", "logprobs", "top_logprobs", "features", "cache_salt", "max_compute", "constraint")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    epoch: int
    start_pos: int
    context: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[bytes]
    sampling: Sampling
    bonus: BonusPolicy
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    features: bool
    cache_salt: str
    max_compute: int
    constraint: GrammarConstraint
    def __init__(self, seq_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start_pos: _Optional[int] = ..., context: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[bytes]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., bonus: _Optional[_Union[BonusPolicy, str]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., features: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., max_compute: _Optional[int] = ..., constraint: _Optional[_Union[GrammarConstraint, _Mapping]] = ...) -> None: ...

class GrammarConstraint(_message.Message):
    __slots__ = ("kind", "text", "output_start", "end_token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    text: str
    output_start: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., text: _Optional[str] = ..., output_start: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("batch_id", "items", "release_seq_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ..., release_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("seq_id", "epoch", "n_accepted", "kind", "next_token", "path", "logprobs", "features", "cached_tokens", "context_fed", "grammar_dead_end")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    N_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    epoch: int
    n_accepted: int
    kind: NextTokenKind
    next_token: int
    path: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    features: Features
    cached_tokens: int
    context_fed: int
    grammar_dead_end: bool
    def __init__(self, seq_id: _Optional[int] = ..., epoch: _Optional[int] = ..., n_accepted: _Optional[int] = ..., kind: _Optional[_Union[NextTokenKind, str]] = ..., next_token: _Optional[int] = ..., path: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., context_fed: _Optional[int] = ..., grammar_dead_end: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyError(_message.Message):
    __slots__ = ("seq_id", "kind", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    kind: VerifyErrorKind
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., kind: _Optional[_Union[VerifyErrorKind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class VerdictBatch(_message.Message):
    __slots__ = ("batch_id", "verdicts", "errors", "forward_seconds", "kv", "grammar")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    errors: _containers.RepeatedCompositeFieldContainer[VerifyError]
    forward_seconds: float
    kv: KVUsage
    grammar: GrammarWork
    def __init__(self, batch_id: _Optional[int] = ..., verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[VerifyError, _Mapping]]] = ..., forward_seconds: _Optional[float] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., grammar: _Optional[_Union[GrammarWork, _Mapping]] = ...) -> None: ...

"""The server's one configuration (pure): model name, prefix-cache budget and shared tier (and its key), the
prefix cache's grid checkpoints, queue bound, batching policy, request body limit, default reply length,
shutdown grace."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstate.errors import KVStateError
from kvstate.prefix.grid import GridConfig
from kvstate.prefix.remote import check_remote_url
from kvstate.serve.policy import BatchPolicy
from kvstate.validate import check_int


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # the name /v1/models lists and requests must name
    budget_bytes: int | None = 1 << 30  # prefix-cache byte budget; None serves without a prefix cache
    max_queue: int = 256  # requests waiting beyond the batch's free rows; one more is answered 503 at once
    default_max_tokens: int = 256  # a chat request without max_tokens (completions default to 16, as OpenAI's)
    chat_template: str | None = None  # a Jinja chat template overriding the tokenizer's (and the default)
    remote: str | None = None  # the prefix cache's shared tier, "redis://host:port/db" (replicas share prefixes)
    max_body_bytes: int = 4 << 20  # a request body over this is answered 413 before it is read in full
    remote_key_file: str | None = None  # the shared tier's cluster key (None: $KVSTATE_REMOTE_KEY, else unkeyed)
    policy: BatchPolicy = field(default_factory=BatchPolicy)  # admission order, batch size, prefill chunk
    # requests tokenized / rendered at once (each holds up to its prompt's tokens); more wait, counted in max_queue
    max_preparing: int = 2
    # seconds the requests admitted before a SIGTERM may run on; then they are ended (a stream with an error event)
    shutdown_grace_s: float = 30.0
    # recurrent-state checkpoints every `grid.block` tokens of a prefill (hybrids), so a prefix's second sighting
    # resumes at most one block before it diverges; GridConfig(block=0) turns them off
    grid: GridConfig = field(default_factory=GridConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise KVStateError(f"model_id: must be a non-empty name, got {self.model_id!r}")
        if self.budget_bytes is not None:
            check_int("budget_bytes", self.budget_bytes, 1, error=KVStateError,
                      hint="; pass the prefix cache's byte budget, or None for no cache")
        if self.remote is not None:
            if self.budget_bytes is None:
                raise KVStateError("remote: a shared tier needs the prefix cache; drop --no-cache or --remote")
            check_remote_url(self.remote)
        check_int("max_queue", self.max_queue, 1, 1 << 20, error=KVStateError)
        check_int("max_body_bytes", self.max_body_bytes, 1, 1 << 40, error=KVStateError,
                  hint="; pass the largest request body to accept, in bytes")
        check_int("default_max_tokens", self.default_max_tokens, 1, 1 << 24, error=KVStateError)
        check_int("max_preparing", self.max_preparing, 1, 1024, error=KVStateError,
                  hint="; pass how many requests may be tokenized at once")
        if isinstance(self.shutdown_grace_s, bool) or not isinstance(self.shutdown_grace_s, (int, float)) \
                or not 0 <= self.shutdown_grace_s <= 86_400:
            raise KVStateError(f"shutdown_grace_s: must be a number of seconds in 0..86400, got "
                               f"{self.shutdown_grace_s!r}; pass how long running requests may finish after SIGTERM")
        if self.remote_key_file is not None and self.remote is None:
            raise KVStateError("remote_key_file: a key signs the shared tier's entries; pass --remote too, or drop the key")
        if not isinstance(self.policy, BatchPolicy):
            raise KVStateError(f"policy: must be a BatchPolicy, got {type(self.policy).__name__}")
        if not isinstance(self.grid, GridConfig):
            raise KVStateError(f"grid: must be a GridConfig, got {type(self.grid).__name__}")

    @property
    def cache_enabled(self) -> bool:
        return self.budget_bytes is not None

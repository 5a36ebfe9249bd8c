"""The step protocol between the engine and the device workers: plain data, no torch.

The slot changes are what the ranks do to their state; the engine makes them from the scheduler's plan, which
speaks of requests (runtime/scheduler.py), so the devices never import the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RetireSlot:
    """Free decode slot `hole`; if `moved_from` is set, that (last) slot's state moves into the hole."""

    hole: int
    moved_from: int | None


@dataclass
class PromoteSlot:
    """Move a prefilled request's state from its prefill slot into decode slot `to_slot`, with its KV pages."""

    from_slot: int
    to_slot: int
    pages: list[int]


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling setup; rank 0 keeps it with the request's state slot."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int = 0
    min_tokens: int = 0  # stop_token_ids cannot be drawn before this many tokens
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None  # a speculative step keeps no token past it (None: no limit)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, what its logit gets added) before every draw
    # The request's own matcher of the constraint its output must match (`runtime.grammar`; llguidance's), or None
    grammar: object = field(default=None, compare=False)

    @property
    def needs_counts(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class PrefillCommand:
    token_ids: list[int]
    start: int
    slot: int
    pages: list[int]
    last: bool
    sampling: RowSampling | None = None  # sent with a request's first chunk
    # With the first chunk of a request resuming after a cached prefix whose penalties count prompt ids: the
    # prefix's ids (the chunks never carry them).
    prefix_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the prompt token after the chunk (the MTP head reads each position's next token); 0 for
    # a prompt's last chunk, whose next token is drawn from this step.
    next_token: int = 0
    # Prompt log-probs (None: not asked): the top count, and the prompt tokens the chunk's positions predict (each
    # position's next; a prompt's last position predicts the drawn token, which is not scored).
    prompt_logprobs: int | None = None
    scored_ids: list[int] = field(default_factory=list)


UNKNOWN_TOKEN = -1
# verify_accepted of a row whose last step was speculative and is still in flight (overlap scheduling): how many
# tokens it kept is on rank 0's device, which moves the row's position, roll-back and token index on by it.
KEPT_ON_DEVICE = -1


def positions_past_end(speculative_tokens: int) -> int:
    """KV positions a request may write past its prompt + max_tokens: a verify step's k drafts, and, planned before
    the step ahead of it is back, the k more tokens that step may have kept (the host retires a request one step
    late)."""
    return 2 * speculative_tokens


@dataclass
class StepCommand:
    compactions: list[RetireSlot] = field(default_factory=list)
    released_prefill_slots: list[int] = field(default_factory=list)
    promotions: list[PromoteSlot] = field(default_factory=list)
    # Input token of decode slot i; UNKNOWN_TOKEN where the host plans the step before the last one's tokens are
    # back (overlap scheduling): rank 0 then uses the token it drew (or kept) last for that slot.
    decode_tokens: list[int] = field(default_factory=list)
    # Each row's input position and the index of the token it samples; for a KEPT_ON_DEVICE row, as if its last
    # step kept one token (the device adds the others).
    decode_positions: list[int] = field(default_factory=list)
    decode_token_index: list[int] = field(default_factory=list)
    bucket: int = 0
    prefill: list[PrefillCommand] = field(default_factory=list)
    # Prefix caching: (decode slot, snapshot, kept) copies of requests that end here, before the slot changes (kept:
    # the tokens a last speculative step kept, rolled back to first; 0: none); (snapshot, slot) state restores and
    # (src, dst) KV page copies before the forward; (slot, snapshot) snapshots after it.
    finish_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    restore_snapshots: list[tuple[int, int]] = field(default_factory=list)
    copy_pages: list[tuple[int, int]] = field(default_factory=list)
    save_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding (k drafts a row): for each decode row, how many of its last verify step's k + 1 tokens
    # were kept (1 .. k + 1; the state rolls back to them), 0 where its last step decoded one token or it was
    # promoted this step (nothing to roll back; it drafts from the last hidden state), KEPT_ON_DEVICE where that
    # step is still in flight. Test drafters may send each row's k drafts instead of the head's: one list, or for
    # a KEPT_ON_DEVICE row k + 1, the drafts if that step kept 1 .. k + 1 tokens.
    verify_accepted: list[int] = field(default_factory=list)
    draft_tokens: list[list[list[int]]] | None = None
    speculate: bool = False  # the decode rows draft and verify (k + 1 tokens a row); else one token a row
    step_seed: int = 0  # randomness for unseeded rows
    seq: int = 0  # the step's number, in hand-over order


@dataclass
class SampledToken:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass
class StepResult:
    decode: list[SampledToken]  # one per decode slot
    prefill: list[SampledToken | None]  # one per prefill command; None for chunks that do not end a prompt
    # Speculative decoding: per decode slot, the tokens after decode[i] that its accepted drafts add (in order)
    decode_more: list[list[SampledToken]] = field(default_factory=list)
    # The step's time on rank 0's device, from its first queued operation to its last (`rank.StepClock`): what
    # it cost, even while the host ran a step ahead. 0.0 where unknown.
    device_seconds: float = 0.0
    # How long rank 0's host took to queue the step (on a CPU, to compute it). 0.0 where unknown.
    launch_seconds: float = 0.0
    # Per prefill command that asked for them: its scored prompt tokens' log-probs (None for the others)
    prompt_logprobs: list[list[SampledToken] | None] = field(default_factory=list)


class SlotProtocolError(RuntimeError):
    """A compaction or promotion that does not match the worker's slot occupancy: the replica is poisoned."""

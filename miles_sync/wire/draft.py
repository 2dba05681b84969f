"""What an engine says about its speculative draft: the draft kind and the draft report record."""

from __future__ import annotations

from dataclasses import dataclass

from miles_sync.wire.codec import WireEnum

__all__ = ["DraftKind", "DraftReport"]


class DraftKind(WireEnum):
    """The speculative draft an engine runs. ngram has no draft runner (it drafts from the target's own history)."""

    NONE = "none"
    STANDALONE = "standalone"
    MTP = "mtp"
    NGRAM = "ngram"


@dataclass(frozen=True, kw_only=True)
class DraftReport:
    """What an engine says about its draft; encoded and decoded with miles_sync.wire.protocol.encode/decode.

    `owned_names` are the HF parameter names the draft's loader keeps; `is_frozen` is true when the engine knows
    the draft never receives updates (e.g. a separately trained standalone draft).
    """

    kind: DraftKind
    owned_names: tuple[str, ...] = ()
    is_frozen: bool = False

    @property
    def has_runner(self) -> bool:
        """Whether the draft is a runner of its own (loaded and finalized separately from the target)."""
        return self.kind in (DraftKind.STANDALONE, DraftKind.MTP)

"""What the scheduler hands the engine for one step (app/replica/scheduler.py): the sequences to feed and how
many tokens of each, and which sequences the step preempted or displaced. The batch builder
(app/replica/batch_builder.py) turns it into the model's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.replica.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step: all_ids[start : start + num_tokens]
    start: int  # == seq.num_computed when scheduled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # for lack of KV blocks
    # gave their slot to a claim of a tenant behind: held (kept running with their KV, not scheduled, until a slot
    # frees) or, when the claim needed their KV blocks too, preempted by recompute (then also in num_preemptions)
    displaced: list[Sequence] = field(default_factory=list)
    sitting_out: frozenset = frozenset()  # tenants whose running sequences the policy held out of this step

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

"""The card's memory, shared by the trials on it (`hydra.sweeper.slots_per_gpu` > 1): a trial starts only while its
share fits beside the shares of the trials already running on that card, so more trials run at once where memory
allows (small settings) and fewer where it does not (settings near the budget), never more than the card holds.

A trial's share is what the memory model says it may take on the card, its stated error included (`share_of`),
from a model that may decide (src/sweep/memory.py); without one, its whole budget. Each trial is still capped at
`hardware.vram_budget_gib` (the card it stands in for, CUDA context included): the ledger decides only when it
starts.
Where a trial used more than its share and the card, not its budget, ran out (`src.failures.card_ran_out`), the one
launcher runs it again holding the card alone (`alone`), so a crowded card never writes an OOM on the map.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from src import gpus
from src.sweep.slots import Slot
from src.sweep.stop import stopping

log = logging.getLogger(__name__)
# Left free on a shared card: other processes' contexts and the driver's own (NVML counts them in no trial's share).
RESERVE_GIB = 1.0


class CardLedger:
    """Shares of each shared card's memory (GiB), held while a trial runs on it."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = dict(totals)  # card (the slot's CUDA_VISIBLE_DEVICES) -> GiB the trials on it may hold
        self.held: dict[str, list[float]] = {card: [] for card in totals}
        self.alone_waiting: dict[str, int] = dict.fromkeys(totals, 0)
        self.changed = threading.Condition()
        # each held share's (asked, started, ended) times (time.monotonic), for `summary`
        self.spans: dict[str, list[tuple[float, float, float]]] = {card: [] for card in totals}

    @classmethod
    def for_slots(cls, slots: list[Slot]) -> CardLedger | None:
        """A ledger over the cards that more than one slot shares (None: no card is shared, nothing to decide);
        each card's total is NVML's, less `RESERVE_GIB`."""
        shared = [c for c in {s.env.get("CUDA_VISIBLE_DEVICES", "") for s in slots} if c and "," not in c]
        shared = [c for c in shared if sum(s.env.get("CUDA_VISIBLE_DEVICES") == c for s in slots) > 1]
        totals = {}
        for card in shared:
            total = gpus.total_gib(int(card))
            if total is None:  # NVML cannot say: the slots run as many at once as the user set, as before
                log.warning("card %s: NVML gives no total memory; its %s trials start without the ledger", card,
                            sum(s.env.get("CUDA_VISIBLE_DEVICES") == card for s in slots))  # fmt: skip
                continue
            totals[card] = total - RESERVE_GIB
        return cls(totals) if totals else None

    def shared(self, slot: Slot) -> str | None:
        card = slot.env.get("CUDA_VISIBLE_DEVICES")
        return card if card in self.totals else None

    @contextmanager
    def hold(
        self,
        slot: Slot,
        share_gib: float,
        alone: bool = False,
        beat: Callable[[], None] | None = None,
        every_s: float = 10.0,
    ) -> Iterator[None]:
        """Wait until `share_gib` fits on the slot's card beside the shares held there (`alone`: until nothing else
        runs there), hold it while the block runs. A share larger than the card waits for the card to be empty. A
        trial waiting to run alone holds back new ones, so it is not starved. The sweep's stop ends the wait. `beat`
        (the trial's heartbeat) is called every `every_s` while it waits (hydra.sweeper.heartbeat_interval_s): a
        trial waiting for memory is alive, and any worker would fail it as dead once its heartbeat expired."""
        card = self.shared(slot)
        if card is None:
            yield
            return
        share = self.totals[card] if alone else min(share_gib, self.totals[card])
        asked = time.monotonic()
        with self.changed:
            self.alone_waiting[card] += alone
            beaten = asked
            try:
                while not self.fits(card, share, alone) and not stopping.is_set():
                    self.changed.wait(timeout=0.5)
                    if beat is not None and time.monotonic() - beaten >= every_s:
                        beat()
                        beaten = time.monotonic()
            finally:
                self.alone_waiting[card] -= alone
            self.held[card].append(share)
            started = time.monotonic()
        try:
            yield
        finally:
            with self.changed:
                self.held[card].remove(share)
                self.spans[card].append((asked, started, time.monotonic()))
                self.changed.notify_all()

    def fits(self, card: str, share: float, alone: bool) -> bool:
        held = self.held[card]
        if self.alone_waiting[card] and not alone:  # one waits to run alone: it goes first
            return False
        if not held:
            return True
        return not alone and sum(held) + share <= self.totals[card]

    def summary(self) -> list[str]:
        """One line per shared card: how many trials ran at once (at each start, those running, itself included)
        and how long trials waited for memory."""
        lines = []
        for card, spans in self.spans.items():
            if not spans:
                continue
            at_once = [sum(1 for _, s, e in spans if s <= start < e) for _, start, _ in spans]
            waits = [start - asked for asked, start, _ in spans]
            lines.append(
                f"card {card}: {len(spans)} trials on {self.totals[card]:.1f} GiB, at once: max {max(at_once)}, "
                f"median {statistics.median(at_once):g}; {sum(w > 0.5 for w in waits)} waited for memory "
                f"({sum(waits):.0f} s in all)"
            )
        return lines

"""The pool of recurrent-state slots of a hybrid model (KDA, Mamba-like layers).

A slot indexes one row of every state layer's arrays on the device. A running request holds
exactly one slot from admission until it finishes, is aborted or is preempted; then the slot
returns to the pool, and its next owner starts from a zeroed row (the scheduler lists it in
`SchedulerOutput.reset_state_slots`), never from what the previous owner left there.

Every function is pure: it takes a `StateSlots` value and returns a new one (or a query result).
Misuse raises `StateSlotsError` and leaves the input as it was.
"""

from bisect import insort
from dataclasses import dataclass

from immutables import Map

__all__ = [
    "StateSlots",
    "StateSlotsError",
    "check_invariants",
    "make_state_slots",
    "release",
    "slot_of",
    "take",
]


class StateSlotsError(ValueError):
    """Misuse of the slot pool (a second slot for one request, a release of a slot not held)."""


@dataclass(frozen=True, slots=True)
class StateSlots:
    num_slots: int
    # Free slots in increasing order; a new owner takes the lowest, so a freed slot is soon
    # reused (the case a reset must cover, exercised rather than avoided).
    free: tuple[int, ...]
    # request id -> the slot it holds.
    owners: Map


def make_state_slots(num_slots: int) -> StateSlots:
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
        raise StateSlotsError(f"make_state_slots: num_slots={num_slots!r}, expected an int >= 1")
    return StateSlots(num_slots=num_slots, free=tuple(range(num_slots)), owners=Map())


def slot_of(slots: StateSlots, request_id: str) -> int | None:
    """The slot `request_id` holds, or None."""
    return slots.owners.get(request_id)


def take(slots: StateSlots, request_id: str) -> tuple[StateSlots, int]:
    """Give `request_id` the lowest free slot."""
    held = slots.owners.get(request_id)
    if held is not None:
        raise StateSlotsError(f"take: request {request_id!r} already holds state slot {held}")
    if not slots.free:
        raise StateSlotsError(
            f"take({request_id!r}): all {slots.num_slots} state slots are held "
            f"(by {sorted(slots.owners)})"
        )
    slot = slots.free[0]
    owners = slots.owners.set(request_id, slot)
    return StateSlots(slots.num_slots, slots.free[1:], owners), slot


def release(slots: StateSlots, request_id: str) -> StateSlots:
    """Return the slot `request_id` holds to the pool."""
    slot = slots.owners.get(request_id)
    if slot is None:
        raise StateSlotsError(f"release: request {request_id!r} holds no state slot")
    free = list(slots.free)
    insort(free, slot)
    return StateSlots(slots.num_slots, tuple(free), slots.owners.delete(request_id))


def check_invariants(slots: StateSlots) -> None:
    """Raise AssertionError naming the first broken invariant: no slot is held twice, and free
    and held slots are disjoint and together every slot."""
    held = list(slots.owners.values())
    if len(set(held)) != len(held):
        raise AssertionError(f"a state slot has two owners: {dict(slots.owners)}")
    if list(slots.free) != sorted(set(slots.free)):
        raise AssertionError(f"free state slots not strictly increasing: {slots.free}")
    if set(slots.free) & set(held):
        raise AssertionError(
            f"state slots both free and held: {sorted(set(slots.free) & set(held))}"
        )
    if sorted((*slots.free, *held)) != list(range(slots.num_slots)):
        raise AssertionError(
            f"free {slots.free} and held {sorted(held)} state slots are not exactly "
            f"0..{slots.num_slots - 1}"
        )

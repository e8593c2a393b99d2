"""Which rank the others waited for, from each rank's meetings (the collectives every
rank joins): arrivals aligned across clocks, lateness, and the rank that stands out
above the noise.

Works on plain data (each rank's summary: `starts`, `ends` and `names` of its meetings).
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

# A rank whose stretches between meetings are this much longer than the median rank's
# in all (ns), stretch by stretch the median over those of one kind, stands out: below
# it, the ranks take turns arriving last, as noise makes them.
NOISE = 1_000_000
# The share of the stretches of a kind at which a rank must work longer than the median
# rank for its lateness there to count as systematic.
STEADY = 0.8
# The share of all the waiting at the meetings a rank's systematic lateness must make
# up to stand out.
SHARE = 0.1
# The share of the profile's span it must make up too: a rank a hair slower than the
# others in every stretch (its launcher's or its MPI library's own work, say) is not
# what anyone waits for.
SPAN_SHARE = 0.02
# A rank the others waited for stands out too, however few of the meetings it came last
# at (a rank slowed once per pair of calls, say), where the waiting for it is at least
# this share of all the waiting at the meetings, twice any other rank's ...
WAITED = 0.5
# ... and at least this share of the profile's span: waiting anyone would see.
WAITED_SPAN_SHARE = 0.1


def arrivals_at_meetings(every: Sequence[dict[str, Any]]) -> np.ndarray:
    """**Returns:** ranks x meetings, each rank's arrival minus the last rank's (ns),
    over the meetings every rank reached alike (the same names, in the same order).

    The clocks start together at a barrier as the profile begins; each rank's clock
    is then aligned by its meetings' ends: the ranks leave a collective together, so the
    median over the meetings of how much later a rank's ends read than rank 0's is its
    clock's offset (robust to the odd meeting a rank leaves late)."""
    if len(every) < 2 or any("starts" not in m for m in every):
        return np.zeros((len(every), 0))
    n = _alike(every)
    if n == 0:
        return np.zeros((len(every), 0))
    starts = np.array([m["starts"][:n] for m in every], dtype=np.float64)
    ends = np.array([m["ends"][:n] for m in every], dtype=np.float64)
    offsets = np.median(ends - ends[0], axis=1)
    arrived = starts - offsets[:, None]
    return arrived - arrived.max(axis=0)


def lateness(arrivals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """**Returns:** per rank, how long (ns) the others waited in all at the meetings it
    reached last, and at how many it did."""
    ranks = arrivals.shape[0]
    late, last = np.zeros(ranks), np.zeros(ranks, dtype=np.int64)
    if arrivals.size == 0:
        return late, last
    latest = np.argmax(arrivals, axis=0)  # (ties: the lowest rank)
    waited = -arrivals.sum(axis=0)
    np.add.at(late, latest, waited)
    np.add.at(last, latest, 1)
    return late, last


def standing_out(every: Sequence[dict[str, Any]]) -> int | None:
    """The rank the others waited for, or None where none stands out.

    Between two meetings each rank works on its own, from leaving one (the ranks leave
    a collective together) to arriving at the next: the rank whose stretch is the
    longest arrives last. Against the median rank's, per kind of stretch (the names of
    the meetings it joins), the median over the stretches keeps what is systematic and
    drops the noise of a rank descheduled now and then; it counts where the rank worked
    longer at `STEADY` of those stretches or more. A rank stands out where that, summed
    over the stretches, is above `NOISE`, above `SHARE` of all the waiting at the
    meetings and `SPAN_SHARE` of the profile's span, and twice any other rank's.

    A rank stands out as well where the waiting for it (at the meetings it came last
    at) is most of all the waiting (`WAITED`, and twice any other rank's) and a visible
    share of the span (`WAITED_SPAN_SHARE`), above `NOISE`: however few of the meetings
    it came last at, as where it is slow once per pair of calls.

    **Arguments:**
    - `every`: per rank, its summary (`starts`, `ends` and `names` of its meetings).

    **Returns:** the rank, or None.
    """
    ranks = len(every)
    if ranks < 2 or any("starts" not in m for m in every):
        return None
    n = _alike(every)
    if n < 2:
        return None
    starts = np.array([m["starts"][:n] for m in every], dtype=np.float64)
    ends = np.array([m["ends"][:n] for m in every], dtype=np.float64)
    stretches = starts[:, 1:] - ends[:, :-1]
    longer = stretches - np.median(stretches, axis=0)
    names = every[0]["names"]
    kinds = np.array([f"{names[k]} -> {names[k + 1]}" for k in range(n - 1)])
    score = np.zeros(ranks)
    for kind in dict.fromkeys(kinds.tolist()):
        chosen = kinds == kind
        # (systematic: longer than the median rank's at most stretches of the kind, as
        # chance makes one rank at about half of them)
        steady = np.mean(longer[:, chosen] > 0, axis=1) >= STEADY
        score += np.where(steady, int(chosen.sum()) * np.maximum(
            np.median(longer[:, chosen], axis=1), 0.0), 0.0)
    order = np.argsort(score)[::-1]
    top, second = int(order[0]), float(score[order[1]])
    # (and a tenth of all the waiting at the meetings: less is the machine's noise)
    late, _ = lateness(arrivals_at_meetings(every))
    span = float(np.max(ends[:, -1] - ends[:, 0]))
    enough = max(NOISE, SHARE * float(late.sum()), SPAN_SHARE * span)
    if score[top] >= enough and score[top] >= 2 * second:
        return top
    return _waited_for(late, span)


def _waited_for(late: np.ndarray, span: float) -> int | None:
    """**Returns:** the rank the others waited for most (see `standing_out`), or None."""
    order = np.argsort(late)[::-1]
    top, most, second = int(order[0]), float(late[order[0]]), float(late[order[1]])
    if most >= max(NOISE, WAITED * float(late.sum()), WAITED_SPAN_SHARE * span, 2 * second):
        return top
    return None


def _alike(every: Sequence[dict[str, Any]]) -> int:
    """**Returns:** how many meetings, from the first, every rank reached alike (the
    same names in the same order)."""
    names = [m["names"] for m in every]
    n = min(len(x) for x in names)
    for k in range(n):
        if any(x[k] != names[0][k] for x in names):
            return k  # (ranks that met differently from here on: compared up to here)
    return n

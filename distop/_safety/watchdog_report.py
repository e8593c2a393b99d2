"""The watchdog's report when it aborts a job: where every rank stands, grouped, with
what the peers last said (`report`), and the groups a relay sends on (`groups_of`)."""

import json
import math

from .._config import settings
from .marks import UNSEEN_PATIENCE, State

OUTSIDE, COMPUTING, WAITING, UNSEEN, EXITING = State  # (short names inside this module)


def report(rank: int, size: int, stuck: list, limit: float, now: float, heard: dict,
           asked: dict, blind: str, relayed: dict | None = None) -> str:
    """The watchdog's message: where this rank is stuck and where the others stand.

    **Arguments:**
    - `rank`, `size`: this rank and the number of ranks, in the world.
    - `stuck`: (state, description, seconds, patience) of each step past its limit.
    - `limit`: `settings.watchdog`.
    - `now`: the time (`time.monotonic`).
    - `heard`: world rank -> (when, state, description, seconds) of its last answer.
    - `asked`: world rank -> when it was last asked.
    - `blind`: why the other ranks cannot be asked, or "".
    - `relayed`: a relay's world rank -> (when, groups) of its last summary.

    **Returns:** the message, one line per fact.
    """
    lines = []
    for state, where, seconds, _ in stuck:
        if state == UNSEEN:
            lines.append(
                f"distop watchdog: rank {rank} of {size} has spent {_s(seconds)} s in "
                f"{where}: computing, or waiting on its requests, which distop cannot tell "
                f"apart (limit {UNSEEN_PATIENCE} x DISTOP_WATCHDOG={limit:g} s).")
        else:
            lines.append(
                f"distop watchdog: rank {rank} of {size} has waited {_s(seconds)} s in "
                f"{where} (limit DISTOP_WATCHDOG={limit:g} s of waiting; time a method "
                "spends computing does not count).")
    if blind:
        lines.append(f"Where the other ranks stand is unknown: {blind}.")
    else:
        lines.append("Where the other ranks stand, as they last answered:")
        groups = grouped(peer_standings(rank, now, limit, heard, asked, relayed or {}))
        for (state, where, silent), peers, shortest, longest, oldest, _ in groups:
            if state is None:
                text = (f"no answer (asked {_s(longest)} s ago): it may have exited or "
                        "crashed, or hold the GIL in a long computation")
            else:
                took = (f"{_s(shortest)}-{_s(longest)} s" if _s(longest) != _s(shortest)
                        else f"{_s(longest)} s")
                text = _say_standing(state, where, took)
                if silent:
                    text = f"no answer for {_s(oldest)} s; before that, {text}"
                elif oldest >= 1:
                    text += f" (answered {_s(oldest)} s ago)"
            lines.append(f"  rank{'s' if len(peers) > 1 else ''} {_ranges(peers)}: {text}")
        if not groups:
            lines.append("  none has been asked yet")
    # (the checking mode names a rank whose schedule differs only while that rank still
    # takes part in the checks: not one that left, or that waits elsewhere)
    hint = ("the checking mode is on, and that rank answers no check" if
            settings.check_collectives else "DISTOP_CHECK_COLLECTIVES=1 names it")
    lines.append("No other rank is known to be computing: one failed, exited, or runs a "
                 f"different schedule (rank-dependent control flow; {hint}). "
                 "Aborting the job.")
    return "\n".join(lines) + "\n"


def peer_standings(rank: int, now: float, limit: float, heard: dict, asked: dict,
             relayed: dict) -> dict:
    """Where every other rank stands, from its own answers and the relays' summaries.

    **Arguments:** as `report`'s (`rank`: this rank, left out).

    **Returns:** world rank -> (key, shortest, longest, oldest, youngest): the key is
    (state, description, whether it has not answered since it was last asked), or
    (None, "", False) for a rank asked that never answered; then the seconds it has
    been there (a range where a relay summed up a group; for a rank that never
    answered, since it was asked), and how old the answers are (infinite where there
    is none). Where both tell of a rank, the younger answer stands.
    """
    found: dict[int, tuple] = {}
    for peer in set(asked) | set(heard):
        if peer == rank:
            continue
        answer = heard.get(peer)
        if answer is None:  # (no answer: older than any, so that any answer stands)
            ago = now - asked[peer]
            found[peer] = ((None, "", False), ago, ago, math.inf, math.inf)
            continue
        when, state, where, seconds = answer
        age = now - when
        silent = asked.get(peer, when) - when > limit  # (asked since, in vain)
        found[peer] = ((state, where, silent), seconds + age, seconds + age, age, age)
    for received, groups in relayed.values():
        late = now - received
        for state, where, silent, spans, *times in groups:
            shortest, longest, oldest, youngest = (t + late for t in times)
            for start, stop in spans:
                for peer in range(start, stop + 1):
                    known = found.get(peer)
                    if peer != rank and (known is None or known[4] > youngest):
                        found[peer] = ((state, where, silent), shortest, longest, oldest,
                                       youngest)
    return found


def grouped(members: dict) -> list:
    """**Returns:** (key, ranks, shortest, longest, oldest, youngest) of each group of
    `members` (see `members`) that stand alike, in the order of their lowest rank."""
    groups: dict[tuple, list] = {}
    for peer in sorted(members):
        key, shortest, longest, oldest, youngest = members[peer]
        group = groups.setdefault(key, [key, [], shortest, longest, oldest, youngest])
        group[1].append(peer)
        group[2:] = (min(group[2], shortest), max(group[3], longest), max(group[4], oldest),
                     min(group[5], youngest))
    return [tuple(group) for group in groups.values()]


def groups_of(data: bytes) -> list:
    """**Returns:** the groups of a relay's summary (see `Watchdog._summary`); none
    where it cannot be read."""
    try:
        return [(state, where, bool(silent), [tuple(span) for span in spans],
                 *map(float, times))
                for state, where, silent, spans, *times in json.loads(data)]
    except (ValueError, TypeError):
        return []


def _s(seconds: float) -> str:
    """**Returns:** a number of seconds, to a tenth below 10."""
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _say_standing(state: State, where: str, took: str) -> str:
    """**Returns:** a peer's answer, in words (`took`: how long it has been there)."""
    if state == COMPUTING:
        return f"computing in {where} for {took}"
    if state == WAITING:
        return f"waiting in {where} for {took}"
    if state == UNSEEN:
        return f"in {where} for {took} (computing, or waiting on its requests)"
    if state == EXITING:
        return f"at its exit for {took}: its program has ended"
    return f"outside distop for {took} (in its own code, or tracing or compiling)"


def spans(ranks: list) -> list:
    """**Returns:** sorted ranks as runs, [[first, last], ...]."""
    spans: list = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return spans


def _ranges(ranks: list) -> str:
    """**Returns:** sorted ranks as ranges, `"0-3, 7"`."""
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans(ranks))

"""The lean tracing sessions: the token while a program is traced, and the JAX setting
that keeps JAX from reusing, in one program, a body traced with another's host calls.

JAX keys its caches of traced bodies (of loops, branches, checkpoints, inner jits, and
jax.numpy's own jitted functions) on the values of its settings (`_compat.lean_session`
is one). A scope (a session, or a trace for structure only) sets a value of its own, so
a body it traces with host calls belongs to it alone. A value is taken from `_values`
and given back when the scope ends; a scope that bound a call where JAX may keep it
(anywhere but its program's own trace) keeps its value out of use until every such
call is gone, since only then does no cache entry of that value hold one. So bodies
without host calls, such as jax.numpy's, are traced once for all Problems rather than
once per program, and the values of a Problem that is dropped serve the next one (see
docs/performance.md#problems-made-and-dropped).
"""

import heapq
import threading
import weakref
from typing import Any, NamedTuple

from .._compat import ProgramTrace, current_trace, lean_session
from .base import HostCallable


class _Values:
    """The values of `lean_session` that scopes take and give back.

    A value is free when no cache entry JAX made while it was set can hold a host call:
    every call bound where JAX may keep it is gone (they are held weakly).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []  # (a heap: the smallest value first)
        self._kept: dict[int, weakref.WeakSet[HostCallable]] = {}
        self._made = 0  # (values 1 to `_made`; 0 is the setting's outside any scope)

    def take(self) -> int:
        """**Returns:** a free value, which no other scope holds until it is given back."""
        with self._lock:
            for value in [v for v, host_calls in self._kept.items() if not host_calls]:
                del self._kept[value]
                heapq.heappush(self._free, value)
            if self._free:
                return heapq.heappop(self._free)
            self._made += 1
            return self._made

    def give_back(self, value: int, kept: "weakref.WeakSet[HostCallable]") -> None:
        """Give `value` back once its scope ends.

        **Arguments:**
        - `value`: the value `take` returned.
        - `kept`: the calls the scope bound where JAX may keep them (held weakly).
        """
        with self._lock:
            if kept:
                self._kept[value] = kept
            else:
                heapq.heappush(self._free, value)

    def count(self) -> "Values":
        """**Returns:** how many values were made, and how many are out of use."""
        with self._lock:
            free = len(self._free) + sum(not c for c in self._kept.values())
            return Values(self._made, self._made - free)


class Values(NamedTuple):
    """How many values of the setting scopes have taken."""

    made: int  # (values 1 to `made`)
    in_use: int  # held by a scope under way, or kept by its calls


_values = _Values()


class Session:
    """Holds the current token while `Problem` traces one program with the lean path."""

    def __init__(self, token: Any) -> None:
        self.token = token  # (a tracer of the program being traced)
        self.trace = current_trace()  # the program's own trace

    def at_top(self) -> bool:
        """Whether a call bound now belongs to the program itself, where it takes the
        session's token: not to the body of the model's own loop, branch, checkpoint or
        inner jit, whose token is threaded after tracing (see `_compiler/stages/nested.py`).

        Transformations (vmap, jvp, linearize) keep a call at the top: their traces
        lead, parent after parent, to the program's own trace. A body has a trace of
        its own."""
        return _program_trace(current_trace()) is self.trace


def _program_trace(trace: Any) -> Any:
    """**Returns:** the trace that makes a program to which `trace` leads, parent after
    parent (`trace` itself where it makes one), or None."""
    while not isinstance(trace, ProgramTrace):
        trace = getattr(trace, "parent_trace", None)
        if trace is None:
            return None
    return trace


_state = threading.local()


def session() -> Session | None:
    """**Returns:** the active `Session`, or None outside lean tracing."""
    return getattr(_state, "session", None)


class _scope:
    """Context manager: a value of the JAX setting `_compat.lean_session` of its own and
    `session` as the current session while it lasts, so that JAX traces afresh inside
    it every body that another scope traced with host calls: a body traced with its
    calls in one scope is not reused by another program, or outside a Problem."""

    def __init__(self, session: Session | None) -> None:
        self.session = session
        # the program's own trace: JAX keeps no body traced there
        self.trace = current_trace() if session is None else session.trace
        self.kept: weakref.WeakSet[HostCallable] = weakref.WeakSet()

    def __enter__(self) -> Session | None:
        self.previous = session(), getattr(_state, "scope", None)
        self.value = _values.take()
        self.key = lean_session(self.value)
        self.key.__enter__()
        _state.session, _state.scope = self.session, self
        return self.session

    def __exit__(self, *exc: object) -> None:
        _state.session, _state.scope = self.previous
        self.key.__exit__(*exc)
        _values.give_back(self.value, self.kept)

    def bound(self, trace: Any, call: HostCallable) -> None:
        """Note `call` bound into `trace`: kept where `trace` makes a body JAX may keep
        in its caches (a program other than this scope's own)."""
        if isinstance(trace, ProgramTrace) and trace is not self.trace:
            self.kept.add(call)


def bound(trace: Any, call: HostCallable) -> None:
    """Note, in the scope under way if any, that `call` was bound into `trace` (see
    `_scope.bound`). The primitive calls it as each call is bound.

    **Arguments:**
    - `trace`: the trace the call is bound into.
    - `call`: the call (the primitive's parameter).
    """
    scope = getattr(_state, "scope", None)
    if scope is not None:
        scope.bound(trace, call)


def values() -> Values:
    """**Returns:** how many values of the setting scopes took, and how many are out of
    use (see `_Values`)."""
    return _values.count()


class tracing(_scope):
    """Context manager: trace a program with the lean path, starting from `token`."""

    def __init__(self, token: Any) -> None:
        super().__init__(Session(token))

    def __enter__(self) -> Session:
        started = super().__enter__()
        assert started is not None  # (made in `__init__`)
        return started


class paused(_scope):
    """Context manager: trace a model for its structure only (its kinds), never to be
    run: without the lean path, every call unordered (JAX then refuses none inside its
    own transformations). A setting of its own keeps JAX from reusing bodies traced
    here in a session's program."""

    def __init__(self) -> None:
        super().__init__(None)

    def __enter__(self) -> None:
        _state.structure_only = getattr(_state, "structure_only", 0) + 1
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _state.structure_only -= 1


def structure_only() -> bool:
    """Whether the trace under way is for its structure only (see `paused`)."""
    return bool(getattr(_state, "structure_only", 0))

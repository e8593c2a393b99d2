"""Tracebacks as a failing rank shows them: Python's, without distop's own frames where
they add nothing."""

import os
import traceback

from .._errors import DistopError

# (the package: this module sits one level below it)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def format_exception(error: BaseException) -> str:
    """Format an exception and its chain as Python does, without distop's own frames
    where they add nothing.

    Those are the frames between the user's frames, and those below the last of them
    when distop raised the error on purpose (a `DistopError`, whose message says what
    went wrong). A stack of distop's frames only is shown whole.

    **Arguments:**
    - `error`: the exception.

    **Returns:** the text, ending with a newline.
    """
    shown = traceback.TracebackException.from_exception(error)
    seen: set[int] = set()
    pending: list[traceback.TracebackException | None] = [shown]
    while pending:
        part = pending.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        part.stack = _Trimmed.of(part.stack, issubclass(part.exc_type, DistopError))
        pending += [part.__cause__, part.__context__, *(getattr(part, "exceptions", None)
                                                       or ())]
    return "".join(shown.format())


class _Trimmed(traceback.StackSummary):
    """A stack with distop's own frames left out, marked where they were."""

    left_out: dict[int, int]  # index of a kept frame (or the length) -> frames left out

    @classmethod
    def of(cls, stack: traceback.StackSummary, on_purpose: bool) -> traceback.StackSummary:
        """**Returns:** `stack` trimmed (see `format_exception`)."""
        ours = [f.filename.startswith(_PACKAGE) for f in stack]
        if all(ours):
            return stack
        last = max(i for i, o in enumerate(ours) if not o)
        trimmed = cls()
        trimmed.left_out = {}
        run = 0
        for i, frame in enumerate(stack):
            if ours[i] and (i < last or on_purpose):
                run += 1
                continue
            if run:
                trimmed.left_out[len(trimmed)] = run
                run = 0
            trimmed.append(frame)
        if run:
            trimmed.left_out[len(trimmed)] = run
        return trimmed

    def format(self) -> list[str]:
        lines = []
        for i, frame in enumerate([*self, None]):
            if self.left_out.get(i):
                n = self.left_out[i]
                lines.append(f"  [{n} frame{'s' * (n > 1)} inside distop left out]\n")
            if frame is not None:
                lines.append(self.format_frame_summary(frame))
        return lines

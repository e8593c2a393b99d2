"""What an operator's method may do with its communicator: what its class declared.

An operator declares the communication each method issues (`forward_collectives`,
`vjp_collectives`, `jvp_collectives`). distop relies on it: a method that declares none
is local, so distop may call it on the rows it needs on each rank alone, and those
differ between ranks. A method that communicates without saying so would then meet
partners that never come. So the communicator a method receives refuses, on the spot,
every communication its class did not declare, and the names are checked when the
class is made.
"""

import difflib
from typing import Any

from .._errors import OperatorError
from .._mpi.names import COMMUNICATING, POINT_TO_POINT

_KNOWN = {name.lower(): name for name in COMMUNICATING}


def check_declarations(cls: type) -> None:
    """Check an operator class's declared communication when the class is made.

    **Raises:** TypeError naming the class, the attribute and the name that is not a
    communicating method of mpi4py's communicators (with the nearest one).
    """
    attributes = sorted(a for a in dir(cls) if a.endswith("_collectives"))
    for attribute in attributes:
        declared = getattr(cls, attribute, ())
        if isinstance(declared, str) or not isinstance(declared, (tuple, list, frozenset,
                                                                  set)):
            raise TypeError(f"{cls.__name__}.{attribute} = {declared!r}: expected a tuple "
                            f"of names, e.g. ('Allreduce',) or ('Sendrecv',).")
        for name in declared:
            if not isinstance(name, str) or name.lower() not in _KNOWN:
                near = difflib.get_close_matches(str(name), sorted(COMMUNICATING), n=1)
                hint = f" Did you mean {near[0]!r}?" if near else ""
                raise TypeError(
                    f"{cls.__name__}.{attribute} names {name!r}, which is not a "
                    f"communicating method of an MPI communicator.{hint} Declare the "
                    "mpi4py methods the method calls, e.g. ('Allreduce',) or "
                    "('Sendrecv',).")


class GuardedComm:
    """The communicator a method receives: the operator's private one, refusing every
    communication its class did not declare for the method's phase.

    Anything else (its rank, size, attributes) passes through. `raw` is the private
    communicator itself, for a library that needs an `MPI.Comm`: what is done through
    it must be declared all the same. `site` is a dict the method may keep what it
    learned at one call site in (a built-in operator's plan, say), given only where
    every rank runs that site alike each time (in a Problem's program, whose shapes
    were agreed); None elsewhere.

    **Arguments:**
    - `comm`: the private communicator.
    - `declared`: the names the method's phase declares.
    - `where`: `Operator.phase`, for messages.
    - `site`: whether to keep a `site` dict (see above).
    """

    def __init__(self, comm: Any, declared: tuple[str, ...], where: str,
                 site: bool = False) -> None:
        self.raw = comm
        self.site: dict | None = {} if site else None
        self._declared = tuple(declared)
        self._allowed = frozenset(name.lower() for name in declared)
        self._where = where

    def __getattr__(self, name: str) -> Any:
        # Called only for names not found on the wrapper itself: each allowed one is
        # kept on it once looked up, so later calls cost a plain attribute lookup.
        if name in COMMUNICATING and name.lower() not in self._allowed:
            self._refuse(name)
        found = getattr(self.raw, name)
        self.__dict__[name] = found
        return found

    def _refuse(self, name: str) -> None:
        cls, phase = self._where.rsplit(".", 1)
        kind = "point-to-point call" if name in POINT_TO_POINT else "collective"
        raise OperatorError(
            f"{self._where} issued [{name!r}], not declared in {phase}_collectives="
            f"{self._declared} (comm.{name} is a {kind}). distop runs a method that "
            "declares no communication as local, possibly on other batch rows on each "
            "rank, so undeclared communication can meet no partner and hang. Add "
            f"{name!r} to {cls}.{phase}_collectives.")

    def __repr__(self) -> str:
        return f"GuardedComm({self.raw!r}, {self._where})"

"""The channel on which the watchdog threads of one communicator's ranks ask each other
where they stand: questions and fixed-size answers, sent and read without ever waiting.
"""

from typing import Any

import numpy as np

from .._mpi.runtime import mpi, world

_ASK, _TELL = 1, 2  # message tags: a question, an answer
_RECORD = 256  # bytes of an answer: state, seconds, then the description in UTF-8


def encode(state: int, text: str, seconds: float) -> np.ndarray:
    """**Returns:** an answer as `_RECORD` bytes."""
    record = np.zeros(_RECORD, np.uint8)
    record[0] = state
    record[8:16] = np.array([seconds], "<f8").view(np.uint8)
    data = text.encode("utf-8")[:_RECORD - 16]
    record[16:16 + len(data)] = np.frombuffer(data, np.uint8)
    return record


def decode(record: np.ndarray) -> tuple:
    """**Returns:** (state, description, seconds) of an answer."""
    text = record[16:].tobytes().rstrip(b"\0").decode("utf-8", "ignore")
    return int(record[0]), text, float(record[8:16].view("<f8")[0])


class Channel:
    """Where the watchdog threads of one communicator's ranks ask each other where they
    stand: a duplicate of its own, which no user code sees.

    A question is one byte (tag `_ASK`), an answer one `_RECORD` (tag `_TELL`). Only the
    watchdog thread sends and receives here, with `Iprobe` and non-blocking sends, so
    that no question or answer can make it wait, whatever a peer is doing.

    **Arguments:**
    - `comm`: the communicator; duplicated here (collective).
    """

    def __init__(self, comm: Any) -> None:
        MPI = mpi()
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        size, mine = self.comm.Get_size(), self.comm.Get_rank()
        group, everyone = self.comm.Get_group(), world().Get_group()
        self.world_ranks = group.Translate_ranks(list(range(size)), everyone)
        group.Free()
        everyone.Free()
        self.peers = [self.world_ranks[r] for r in range(size) if r != mine]
        self._others = [r for r in range(size) if r != mine]
        self._question = np.zeros(1, np.uint8)
        self._scratch = np.zeros(1, np.uint8)
        self._sending: list = []  # (request, buffer) of the messages on their way

    def serve(self, standing: Any, ask: bool) -> list:
        """Answer every question waiting, read every answer, ask every peer if `ask`.

        **Arguments:**
        - `standing`: a function returning (state, description, seconds) of this rank.
        - `ask`: whether to ask the peers.

        **Returns:** (world rank, answer record) of each answer read.
        """
        MPI = mpi()
        status, answers, record = MPI.Status(), [], None
        for _ in range(4 * len(self.world_ranks)):  # (bounded, should a peer flood it)
            if not self.comm.Iprobe(MPI.ANY_SOURCE, _ASK, status):
                break
            source = status.Get_source()
            self.comm.Recv([self._scratch, MPI.BYTE], source, _ASK)
            if record is None:
                record = encode(*standing())
            self._send(record, source, _TELL)
        for _ in range(4 * len(self.world_ranks)):
            if not self.comm.Iprobe(MPI.ANY_SOURCE, _TELL, status):
                break
            source = status.Get_source()
            answer = np.empty(_RECORD, np.uint8)
            self.comm.Recv([answer, MPI.BYTE], source, _TELL)
            answers.append((self.world_ranks[source], answer))
        if ask:
            for peer in self._others:
                self._send(self._question, peer, _ASK)
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]
        return answers

    def _send(self, data: np.ndarray, peer: int, tag: int) -> None:
        self._sending.append((self.comm.Isend([data, mpi().BYTE], peer, tag), data))

    def close(self) -> None:
        """Let go of the messages still on their way (MPI delivers them by itself)."""
        for request, _ in self._sending:
            try:
                if not request.Test():
                    request.Free()
            except Exception:  # noqa: BLE001,S110 - at exit, nothing left to tell
                pass
        self._sending = []

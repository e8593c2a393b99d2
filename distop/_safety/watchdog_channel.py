"""The channel on which the watchdog threads of one communicator's ranks ask where they
stand: questions, fixed-size answers and relayed summaries, sent and read without ever
waiting.
"""

from typing import Any

import numpy as np

from .._mpi.runtime import mpi, world

_ASK, _TELL, _RELAY = 1, 2, 3  # message tags: a question, an answer, a relayed summary
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

    Its rank 0, the relay, asks every other rank; every other rank asks the relay only,
    which answers with a summary of what the ranks answered it (`Watchdog` makes it).
    So a round of questions is a number of messages linear in the number of ranks, even
    where every rank waits. A rank whose relay has not answered for `patience` seconds
    asks every rank itself, as the relay does.

    A question is one byte (tag `_ASK`), an answer one `_RECORD` (tag `_TELL`), a
    summary a few bytes per group of ranks that answered alike (tag `_RELAY`). Only the
    watchdog thread sends and receives here, with `Iprobe` and non-blocking sends, so
    that no message can make it wait, whatever a peer is doing.

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
        self.relays = mine == 0
        self.relay = self.world_ranks[0]  # (its world rank)
        self._others = [r for r in range(size) if r != mine]
        self._question = np.zeros(1, np.uint8)
        self._scratch = np.zeros(1, np.uint8)
        self._sending: list = []  # (request, buffer) of the messages on their way
        self._unanswered: float | None = None  # since when the relay owes an answer

    def serve(self, standing: Any, summary: Any, ask: bool, now: float,
              patience: float) -> tuple[list, list, bool, list]:
        """Answer every question waiting, read every answer and summary, and ask if `ask`.

        **Arguments:**
        - `standing`: a function returning (state, description, seconds) of this rank.
        - `summary`: a function returning the relay's summary, as bytes.
        - `ask`: whether to ask (the relay asks every rank, another rank the relay).
        - `now`: the time (`time.monotonic`).
        - `patience`: seconds after which a rank the relay has not answered asks every
          rank itself.

        **Returns:** (world rank, answer record) of each answer read; each summary read,
        as bytes; whether another rank asked this one; the world ranks asked.
        """
        MPI = mpi()
        status, answers, summaries, askers = MPI.Status(), [], [], []
        for _ in range(4 * len(self.world_ranks)):  # (bounded, should a peer flood it)
            if not self.comm.Iprobe(MPI.ANY_SOURCE, _ASK, status):
                break
            askers.append(status.Get_source())
            self.comm.Recv([self._scratch, MPI.BYTE], askers[-1], _ASK)
        if askers:
            reply, tag = ((np.frombuffer(summary(), np.uint8), _RELAY) if self.relays
                          else (encode(*standing()), _TELL))
            for source in askers:
                self._send(reply, source, tag)
        for _ in range(4 * len(self.world_ranks)):
            if not self.comm.Iprobe(MPI.ANY_SOURCE, _TELL, status):
                break
            source = status.Get_source()
            answer = np.empty(_RECORD, np.uint8)
            self.comm.Recv([answer, MPI.BYTE], source, _TELL)
            answers.append((self.world_ranks[source], answer))
        while self.comm.Iprobe(MPI.ANY_SOURCE, _RELAY, status):  # (from the relay only)
            data = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            self.comm.Recv([data, MPI.BYTE], status.Get_source(), _RELAY)
            summaries.append(data.tobytes())
            self._unanswered = None
        asked: list = []
        if ask:
            silent = self._unanswered is not None and now - self._unanswered > patience
            targets = self._others if self.relays or silent else [0]
            if not self.relays and self._unanswered is None:
                self._unanswered = now
            for peer in targets:
                self._send(self._question, peer, _ASK)
            asked = [self.world_ranks[peer] for peer in targets]
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]
        return answers, summaries, bool(askers), asked

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

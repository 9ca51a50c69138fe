"""One job at a time on the model, in arrival order, and each waiting job knows its place.

The race, the τ sweep and the Learn step share one CPU: two at once would each run at half speed and the
race's lanes would time each other's noise. Gradio's own queue would serialise them too, but a job waiting
there cannot say where it stands, shows Gradio's timer text in the status line, and a τ moved while it
waits never reaches it. So these handlers run outside Gradio's queue and take a `Ticket` here instead:
a generator handler yields a readable "waiting" line until its turn, and leaves the line in a `finally`,
which also runs when Gradio closes the generator of a page that went away.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

POLL_S = 0.5   # how often a waiting handler refreshes its line (and Gradio learns whether its page is gone)


@dataclass(eq=False)
class Ticket:
    """One job's place in the line; `what` names it for the others ("a race", "a τ sweep")."""
    what: str
    number: int


class Machine:
    """A FIFO line of tickets; the first one runs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._line: list[Ticket] = []
        self._numbers = itertools.count(1)

    def join(self, what: str) -> Ticket:
        with self._cond:
            ticket = Ticket(what, next(self._numbers))
            self._line.append(ticket)
            return ticket

    def leave(self, ticket: Ticket) -> None:
        """Done, cancelled or abandoned: the next job in line may start (leaving twice is harmless)."""
        with self._cond:
            if ticket in self._line:
                self._line.remove(ticket)
                self._cond.notify_all()

    def ahead(self, ticket: Ticket) -> list[str]:
        """What runs or waits before `ticket` (empty: its turn)."""
        with self._cond:
            if ticket not in self._line:
                raise ValueError(f"ticket {ticket.number} ({ticket.what}) is not in line")
            return [t.what for t in self._line[: self._line.index(ticket)]]

    def wait_turn(self, ticket: Ticket, timeout: float) -> bool:
        """Block until it is `ticket`'s turn or `timeout` passed; True when it may run."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._line) and self._line[0] is ticket, timeout)

    def others_waiting(self, ticket: Ticket) -> int:
        """Jobs in line behind `ticket`: a running job's optional extra work (the timing repeats) gives way."""
        with self._cond:
            return len(self._line) - 1 - self._line.index(ticket) if ticket in self._line else 0

    def busy(self) -> bool:
        with self._cond:
            return bool(self._line)


def waiting_line(ahead: list[str]) -> str:
    """The status line of a job in line: its position and what it waits for, in words."""
    queued = len(ahead) - 1
    more = f" and {queued} more job{'s' if queued != 1 else ''} before this one" if queued else ""
    return (f"◷ Waiting for the machine: position {len(ahead)} in line ({ahead[0]} is running{more}). "
            f"This starts by itself when they end; a τ you move meanwhile applies.")


MACHINE = Machine()   # the server's one model machine


def take_turn(machine: Machine, what: str, show):
    """A generator: join the line, yield `show(waiting line)` while waiting, return the ticket once it may run.
    The caller must `machine.leave(ticket)` in a finally; a generator closed while waiting leaves here."""
    ticket = machine.join(what)
    try:
        while not machine.wait_turn(ticket, 0):
            ahead = machine.ahead(ticket)
            if ahead:   # else its turn came between the two looks
                yield show(waiting_line(ahead))
                machine.wait_turn(ticket, POLL_S)
    except BaseException:   # GeneratorExit too: Gradio closed the page's job while it waited
        machine.leave(ticket)
        raise
    return ticket

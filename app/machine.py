"""One job at a time on the model, in arrival order, and each waiting job knows its place.

The race, the τ sweep and the Learn step share one CPU: two at once would each run at half speed and the
race's lanes would time each other's noise. Gradio's own queue would serialise them too, but a job waiting
there cannot say where it stands, shows Gradio's timer text in the status line, and a τ moved while it
waits never reaches it. So these handlers run outside Gradio's queue and take a `Ticket` here instead:
a generator handler yields a readable "waiting" line until its turn, and leaves the line in a `finally`,
which also runs when Gradio closes the generator of a page that went away.

Gradio closes that generator only at a yield, and a sweep's row or a race's timing repeat computes for many
seconds without one. Such work runs in a thread (`Turn.in_thread`) while the handler keeps yielding, so a
closed page cancels it: it ends at its next forward pass (`stop_at_forward`), and only then does the thread
leave the machine, so the next job never shares the CPU with abandoned work.
"""
from __future__ import annotations

import itertools
import queue
import threading
from contextlib import contextmanager
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


class Cancelled(BaseException):
    """Raised at the next forward pass of work whose page went away. A BaseException, like GeneratorExit, so the
    work's own `except Exception` (which reports a failure on the page) lets it through."""


@contextmanager
def stop_at_forward(lms, stop: threading.Event):
    """Raise Cancelled at the next forward pass of any of `lms` in this thread once `stop` is set. The work runs
    inside mars_core and finetune.evals.evaluate, which take no stop signal, but every step passes through the model's
    forward. Other threads' forwards are left alone (the machine runs one job at a time, but be exact)."""
    from mars_core.decode.backend import net
    me = threading.get_ident()

    def check(_module, _args):
        if stop.is_set() and threading.get_ident() == me:
            raise Cancelled

    nets = {id(net(lm)): net(lm) for lm in lms}   # AR and MARS lanes may share one model
    handles = [n.register_forward_pre_hook(check) for n in nets.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Background:
    """`work(stop)`, a generator, run in a thread; `relay` hands its values to the handler. `done` runs in the
    thread once the work has stopped computing (finished, failed or cancelled)."""

    def __init__(self, work, done, name: str):
        self.stop = threading.Event()
        self._out: queue.Queue = queue.Queue()
        self._done = done
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=name)
        self.thread.start()

    def cancel(self) -> None:
        self.stop.set()

    def _run(self, work) -> None:
        last = ("cancelled", None)
        gen = work(self.stop)
        try:
            while not self.stop.is_set():   # also asked between values, for work between forwards
                try:
                    self._out.put(("value", next(gen)))
                except StopIteration as end:
                    last = ("end", end.value)
                    break
            gen.close()
        except Cancelled:
            pass
        except Exception as exc:
            last = ("error", exc)
        finally:
            self._done()          # the machine first: whoever sees the end may start the next job at once
            self._out.put(last)

    def relay(self, show=lambda value: value, idle=None):
        """A generator: `show(value)` for each of the work's values as they come and `idle` (or `idle()` where it
        is callable) every POLL_S between them (the moments at which Gradio may close the handler); returns the
        work's return value (None when cancelled: only after cancel(), when no page waits for it) and raises its
        exception."""
        while True:
            try:
                kind, value = self._out.get(timeout=POLL_S)
            except queue.Empty:
                yield idle() if callable(idle) else idle
                continue
            if kind == "value":
                yield show(value)
            elif kind == "error":
                raise value
            else:
                return value


class Turn:
    """A job's turn on the machine, left once it ends: by the handler, or by the thread its work moved to."""

    def __init__(self, machine: Machine, ticket: Ticket):
        self.machine, self.ticket = machine, ticket
        self.work: Background | None = None

    def in_thread(self, work, name: str) -> Background:
        """Run `work(stop)` in a thread (Background) that leaves the machine when it stops computing."""
        self.work = Background(work, lambda: self.machine.leave(self.ticket), name)
        return self.work

    def end(self) -> None:
        """The handler's `finally` (also when Gradio closed it): cancel the thread's work, which then leaves the
        machine, or leave it now when no work moved to a thread."""
        if self.work is not None:
            self.work.cancel()
        else:
            self.machine.leave(self.ticket)

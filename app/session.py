"""What the server remembers about each open page's race, in one object per page.

The τ slider and the Race button are separate Gradio events, so the slider cannot hand a running race its new τ
by argument: both look up the page's `PageState` by Gradio's session hash. One lock guards every page's state;
each method reads or writes under it, so a slider move and a race starting at the same moment see one order.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_PAGES = 1000   # pages remembered; the least recently used idle page is forgotten beyond this


@dataclass
class PageState:
    """One page: its running race's τ controls (the slider writes them, the decoders read them each forward),
    the τ the page last set and when (a race that waited for the machine starts with a τ set meanwhile), the
    τ field's last clamp note (the page may send the clamped value only, so the race repeats the note), and
    the page's newest race (an older race of the page stops at its next forward pass)."""
    controls: list | None = None
    tau_set: tuple[float, float] | None = None      # (τ, time.monotonic())
    clamp_note: tuple[float, str] | None = None     # (the τ it was clamped to, the note)
    newest: object | None = None

    @property
    def idle(self) -> bool:
        return self.controls is None and self.newest is None


class Pages:
    """Every page's PageState by session key."""

    def __init__(self, max_pages: int = MAX_PAGES):
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, PageState] = OrderedDict()
        self.max_pages = max_pages

    def _page(self, key: str) -> PageState:
        page = self._pages.get(key)
        if page is None:
            page = self._pages[key] = PageState()
            self._forget_idle()
        self._pages.move_to_end(key)
        return page

    def _forget_idle(self) -> None:
        for key in [k for k, p in self._pages.items() if p.idle][: max(0, len(self._pages) - self.max_pages)]:
            del self._pages[key]

    def set_tau(self, key: str, value: float, notes: list[str]) -> tuple[list[str], list | None]:
        """The page set τ (clamped to `value`, with `notes` saying so): remember it, and steer the running race.
        Returns (the notes to show: the kept clamp note when the page clamped its field to that value itself,
        the running race's controls or None)."""
        with self._lock:
            page = self._page(key)
            page.tau_set = (value, time.monotonic())
            kept = page.clamp_note
            if notes:
                page.clamp_note = (value, notes[0])
            elif kept and abs(kept[0] - value) < 1e-9:   # the page clamping the field to that value: same cause
                notes = [kept[1]]
            else:
                page.clamp_note = None
            controls = page.controls
        for control in controls or ():
            control.value = value
        return notes, controls

    def clamp_note(self, key: str, tau: float) -> str | None:
        """The τ field's last clamp note when a race runs at the value it was clamped to."""
        with self._lock:
            kept = self._page(key).clamp_note
        return kept[1] if kept and abs(kept[0] - tau) < 1e-9 else None

    def tau_set_after(self, key: str, since: float) -> float | None:
        """The τ the page set after `since` (time.monotonic()), if any."""
        with self._lock:
            moved = self._page(key).tau_set
        return moved[0] if moved is not None and moved[1] > since else None

    def start_race(self, key: str) -> object:
        """A new race of the page: it becomes the newest, so an older one stops. Returns its token."""
        token = object()
        with self._lock:
            self._page(key).newest = token
        return token

    def is_newest(self, key: str, token: object) -> bool:
        with self._lock:
            return self._page(key).newest is token

    def end_race(self, key: str, token: object) -> None:
        with self._lock:
            page = self._page(key)
            if page.newest is token:   # no newer race of this page: nothing left to stop
                page.newest = None

    def steer(self, key: str, controls: list) -> None:
        """The race now streaming on this page: the slider moves these τ controls."""
        with self._lock:
            self._page(key).controls = controls

    def release(self, key: str, controls: list) -> None:
        with self._lock:
            page = self._page(key)
            if page.controls is controls:   # a newer race of this page keeps its own
                page.controls = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)


PAGES = Pages()   # the server's pages (the app is one process)

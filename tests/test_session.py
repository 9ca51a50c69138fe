"""One state object per page (issue 50, item 9): the τ slider steers only its own page's race, a page's newer race
supersedes its older one, and the registry forgets idle pages, never a running one."""
from __future__ import annotations

from types import SimpleNamespace

from app.session import Pages


def test_the_slider_steers_only_its_own_pages_running_race():
    pages = Pages()
    mine, other = [SimpleNamespace(value=0.9)], [SimpleNamespace(value=0.9)]
    pages.steer("a", mine)
    pages.steer("b", other)
    notes, controls = pages.set_tau("a", 0.6, [])
    assert controls is mine and mine[0].value == 0.6 and other[0].value == 0.9 and notes == []
    pages.release("a", mine)
    assert pages.set_tau("a", 0.7, [])[1] is None and mine[0].value == 0.6   # no race: nothing steered


def test_a_clamp_note_is_repeated_only_for_the_value_it_clamped_to():
    pages = Pages()
    pages.set_tau("a", 1.0, ["τ 3 is above 1.0: ran with 1.0"])
    assert pages.clamp_note("a", 1.0) == "τ 3 is above 1.0: ran with 1.0"
    assert pages.set_tau("a", 1.0, [])[0] == ["τ 3 is above 1.0: ran with 1.0"]   # the page clamping its field
    assert pages.clamp_note("a", 0.8) is None
    pages.set_tau("a", 0.8, [])
    assert pages.clamp_note("a", 1.0) is None


def test_a_newer_race_supersedes_the_older_one_of_the_same_page_only():
    pages = Pages()
    old = pages.start_race("a")
    elsewhere = pages.start_race("b")
    new = pages.start_race("a")
    assert not pages.is_newest("a", old) and pages.is_newest("a", new) and pages.is_newest("b", elsewhere)
    pages.end_race("a", old)                 # the old one ending leaves the new one newest
    assert pages.is_newest("a", new)


def test_tau_set_after_a_race_was_asked_for_is_reported():
    import time
    pages = Pages()
    pages.set_tau("a", 0.6, [])
    asked = time.monotonic()
    assert pages.tau_set_after("a", asked) is None
    pages.set_tau("a", 0.7, [])
    assert pages.tau_set_after("a", asked) == 0.7


def test_idle_pages_beyond_the_cap_are_forgotten_and_racing_ones_kept():
    pages = Pages(max_pages=3)
    racing = pages.start_race("racing")
    for k in range(10):
        pages.set_tau(f"idle-{k}", 0.9, [])
    assert len(pages) == 3 and pages.is_newest("racing", racing)

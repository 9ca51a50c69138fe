"""Generate tab handlers: load a model, run the race, move τ mid-generation, browse the ledger.

Handlers are plain functions / generators of values (Gradio calls them); decoding is
`mars_core.generate_stream`, scheduling is `app.race.race`. A race runs in steps: the page's values
become a checked `RaceSettings`, then the models load, the lanes stream, and the decoders are timed again.
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

import mars_core   # its names load on first use: torch is imported by the first race, not by the page's start

from app import models, notices, plots, timing
# The input checks live in app.inputs (the Learn and Explorer tabs use them too); ui.py builds its sliders from
# the limits and `lenient` through this module, so they are imported by name here.
from app.machine import MACHINE, Machine, Turn, stop_at_forward, take_turn
from app.inputs import (MAX_NEW_TOKENS, MAX_PROMPT_CHARS, SLOW_MOTION, TAU_MAX, TAU_MIN, check_criterion,  # noqa: F401
                        check_flag, check_inputs, check_seed, check_slow_motion, effective_tau, lenient)
from app.race import LANE_LABELS, LANES, SideRecord, WarmCost, race
from app.race_settings import (FASTEST, LAYOUT_CHOICES, ONE_MASK, RaceInputs, RaceSettings,  # noqa: F401
                               fastest_lossless, lossless_candidates)
from app.session import PAGES
from app.render import render_chunks, render_ledger, render_stats, tau_summary
from app.timing import ReplayTau

if TYPE_CHECKING:
    from mars_core import DecodeConfig, TauControl

YIELD_EVERY_S = 0.05  # coalesce page updates; the race itself is not slowed down
TIMING_STARTS = "◔ timing the decoders again for a speedup you can quote …"   # the status until a repeat ends
# What "confidence ≥ τ" measures (docs/algorithm.md): the decoder's CRITERIA (mars_core.decode.config, which imports
# torch, so they are named here; tests/test_app.py checks they are the same, in the same order), labelled for the page.
_CRITERION_LABELS = {"prob": "probability", "entropy": "exp(−entropy)", "margin": "margin p1−p2"}
CRITERION_CHOICES = [(label, c) for c, label in _CRITERION_LABELS.items()]

def token_texts(lm):
    """id -> display string for one token (end-of-turn shown as ⟨eos⟩)."""
    eos = set(lm.eos_ids)
    cache: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in cache:
            cache[t] = "⟨eos⟩" if t in eos else lm.tokenizer.decode([t], skip_special_tokens=False)
        return cache[t]
    return text


def load_model_ui(choice, free_text, resolver: models.Resolver = models.BUILTINS):
    """Generator for the Load button: progress line first, then a description or a readable error."""
    try:
        name = resolver.resolve(choice, free_text)
    except Exception as exc:
        yield f"⚠ {models.friendly_error(exc)}"
        return
    if not models.is_loaded(name):
        note = models.loading_note(name) or f" {models.load_estimate(name)}".rstrip()
        yield f"Loading **{name}** …{note}"
    try:
        lm, secs = models.load_with_timing(name)
    except Exception as exc:
        yield f"⚠ Could not load **{name}**: {models.friendly_error(exc)}"
        return
    yield f"✓ {models.describe(lm)} · ready ({secs:.1f} s)"


def set_tau(tau, tau_off, request: gr.Request | None = None):
    """τ slider / 'off' box moved: the running race (if any) uses the new τ from its next forward pass.
    An out-of-range τ is clamped, and the line says so."""
    notes: list[str] = []
    try:
        value = effective_tau(tau, tau_off, notes)
    except ValueError as exc:
        return f"⚠ {exc}"
    notes, controls = PAGES.set_tau(_session(request), value, notes)
    note = f" — {notes[0].replace('ran with', 'runs with')}" if notes else ""
    if controls is None:
        return f"τ = {_tau_text(value)} (applies to the next run, and to a race waiting for the machine){note}"
    return f"τ → {_tau_text(value)} from the next forward pass{note}"


def _tau_text(tau: float) -> str:
    return "off" if tau >= 1.0 else f"{tau:.2f}"


def _session(request) -> str:
    return getattr(request, "session_hash", None) or "default"


PLACEHOLDERS = {"ar": "AR output appears here", "verify": "lossless MARS output appears here",
                "mars": "MARS output appears here"}
N_OUTPUTS = 12   # the race's outputs, wired in ui._wire_race


def empty_sides() -> dict[str, SideRecord]:
    """One empty record per lane: the panes before a race, and a race's start."""
    return {n: SideRecord(LANE_LABELS[n], n) for n in LANES}


def _outputs(status, sides, final=False, measured=None, measuring="", tau_line=None, with_state=False):
    """The tuple of values the race yields, in the order of the outputs in ui._wire_race:
    status, τ line, AR pane, lossless pane, MARS pane, stats, 3 plots, ledger step, ledger, state."""
    vals = [status, gr.skip() if tau_line is None else tau_line]
    vals += [render_chunks(sides[n], PLACEHOLDERS[n]) for n in LANES]
    vals.append(render_stats(sides, measured, sides["ar"].label, measuring))
    if final:
        mars, ar = sides["mars"], sides["ar"]
        last = max(0, mars.forwards - 1)
        vals += [plots.tokens_per_forward_figure(mars, sides.get("verify")),
                 plots.acceptance_figure(mars, sides.get("verify")),
                 plots.diff_html(mars.token_strings, ar.token_strings),
                 gr.update(minimum=0, maximum=max(1, last), value=0, interactive=mars.forwards > 1),
                 render_ledger(mars, 0), dict(sides)]
    else:   # the race state again at the end (plots and ledger stay as the user left them)
        vals += [gr.skip()] * 5 + [dict(sides) if with_state else gr.skip()]
    return tuple(vals)


@dataclass
class _Page:
    """What a race shows: the lanes' records, and the notes (clamps, advice) that end every status line."""
    sides: dict[str, SideRecord]
    notes: str = ""

    def show(self, status: str, **kw) -> tuple:
        return _outputs(status + self.notes, self.sides, **kw)


def clear_warning(message):
    """An input changed: a warning (⚠ …) about the old inputs goes; any other message stays."""
    text = message if isinstance(message, str) else ""
    stripped = re.sub(r"<[^>]+>", "", text).strip()
    return "" if stripped.startswith("⚠") else gr.skip()


@dataclass
class _Lane:
    """One decoder of the race; `control` is the τ the slider moves (the MARS lanes only)."""
    lm: object
    cfg: DecodeConfig
    control: TauControl | None = None

    def rerun(self, prompt_ids: list[int], taus: list[float]):
        """A function decoding the prompt once more as the race did: a lane whose τ moved replays its τ per step."""
        replay = self.control is not None and len(set(taus)) > 1
        return lambda: mars_core.generate(self.lm, [prompt_ids], self.cfg,
                                          tau_control=ReplayTau(taus) if replay else None)


def _make_lanes(settings: RaceSettings, lm, ar_lm) -> dict[str, _Lane]:
    def lane(n):
        if n == "ar":
            return _Lane(ar_lm, settings.config(n))
        return _Lane(lm, settings.config(n), mars_core.TauControl(settings.tau))
    return {n: lane(n) for n in settings.lanes}


def choose_models(choice, free_text, ar_choice, resolver: models.Resolver = models.BUILTINS) -> tuple[str, str]:
    """(the MARS lanes' model, the AR lane's): the AR baseline is the same model unless another is picked."""
    name = resolver.resolve(choice, free_text)
    ar_name = name if ar_choice in (None, "", models.SAME_MODEL) else resolver.resolve(ar_choice, "")
    return name, ar_name


def run_race(given: RaceInputs, request: gr.Request | None = None, resolver: models.Resolver = models.BUILTINS):
    """The Race button: stream AR, lossless MARS and MARS side by side, then time the decoders again for a
    speedup you can quote. A generator of `_outputs` tuples."""
    session = _session(request)
    try:
        settings = RaceSettings.from_inputs(given, session)
        name, ar_name = choose_models(given.model, given.free_text, given.ar_choice, resolver)
    except Exception as exc:
        yield _Page(empty_sides()).show(f"⚠ {models.friendly_error(exc)}")
        return
    yield from race_models(settings, name, ar_name, session)


REPLACED = "■ Replaced: this page started a newer race, so this one stopped at its next forward pass"
GAVE_WAY = ("not timed again: another job was waiting for the machine, so the timing gave way "
            "(race again when the machine is free for a speedup you can quote)")


class _Superseded(Exception):
    """The page pressed Race again: this race stops quietly and the newer one takes its panes."""


def race_models(settings: RaceSettings, name: str, ar_name: str, session: str = "default", machine: Machine = MACHINE):
    """The race once its inputs are checked: wait for the machine (saying where it stands), then load the
    models, stream the lanes, show the answers, and time the decoders again within a budget."""
    asked = time.monotonic()
    mine = PAGES.start_race(session)   # an older race of this page stops at its next forward
    turn = Turn(machine, (yield from take_turn(machine, "a race", _status_only)))
    try:
        if not PAGES.is_newest(session, mine):
            raise _Superseded
        _take_tau_moved_while_waiting(settings, session, asked)

        def superseded() -> bool:
            return not PAGES.is_newest(session, mine)

        yield from _race_on_machine(settings, name, ar_name, session, superseded,
                                    lambda: superseded() or machine.others_waiting(turn.ticket) > 0, turn)
    except _Superseded:
        # the last word of this race, for an API client that keeps reading it; on the page the newer race,
        # which waits for this one to leave the machine, writes over it at once
        yield _status_only(REPLACED)
        return
    finally:   # also when Gradio closes this generator because its page went away
        turn.end()
        PAGES.end_race(session, mine)


def _race_on_machine(settings: RaceSettings, name: str, ar_name: str, session: str, superseded, give_way,
                     turn: Turn):
    page = _Page(empty_sides(), _notes_text(settings, name))
    page.sides["ar"].label = "AR (same model, τ off)" if ar_name == name else f"AR ({ar_name})"
    page.sides["verify"].layout = settings.draft_layout
    try:
        lm, ar_lm = yield from _load_models(page, name, ar_name)
    except Exception as exc:
        yield page.show(f"⚠ Could not load the model: {models.friendly_error(exc)}")
        return
    if "verify" in settings.lanes and settings.fastest:
        yield page.show("◔ Timing the lossless layouts on this machine (once per model and setting) …")
        try:
            why = settings.pick_fastest(lm, name)
        except Exception as exc:
            yield page.show(f"⚠ Could not time the lossless layouts: {models.friendly_error(exc)}")
            return
        if why:
            page.notes += f"\n\nℹ {why}"
            page.sides["verify"].layout = settings.draft_layout
    if "verify" not in settings.lanes:
        page.sides["verify"].note = ("lossless MARS reproduces greedy AR, so it runs at temperature 0 only: "
                                     "set temperature to 0 to race it")
    try:
        lanes = _make_lanes(settings, lm, ar_lm)
        yield from _stream_lanes(page, settings, lanes, session, superseded)
    except _Superseded:
        raise
    except Exception as exc:
        yield page.show(f"⚠ Generation failed: {models.friendly_error(exc)}")
        return
    summary, tau_line = _summary(page.sides, lanes), _ran_tau_line(page.sides)
    if not settings.measure_after:
        yield page.show(f"✓ Done: {summary}.", final=True, tau_line=tau_line)
        return
    # the answers, tokens/forward, plots and ledger go out now; the timing follows within its budget
    yield page.show(f"✓ Race finished: {summary}. {TIMING_STARTS}", final=True, tau_line=tau_line,
                    measuring="◔ timing again …")
    try:
        measured = yield from _time_again(page, settings, lanes, summary, tau_line, give_way, turn)
    except Exception as exc:
        yield page.show(f"✓ Done: {summary}. ⚠ the timing after the race failed: {models.friendly_error(exc)}",
                        tau_line=tau_line, with_state=True)
        return
    if superseded():
        raise _Superseded
    yield page.show(f"✓ Done: {summary}." + (" Measured speedups below the table." if measured else
                                              " Not timed again: another job was waiting for the machine."),
                    measured=measured, tau_line=tau_line, with_state=True, measuring="" if measured else GAVE_WAY)


def _status_only(status: str) -> tuple:
    """Outputs that change the status line only (a waiting race leaves the panes of the last one alone)."""
    return (status,) + (gr.skip(),) * (N_OUTPUTS - 1)


def _take_tau_moved_while_waiting(settings: RaceSettings, session: str, asked: float) -> None:
    """A τ set on the page after the race was asked for (it waited for the machine) is the τ it starts with."""
    moved = PAGES.tau_set_after(session, asked)
    if moved is None or abs(moved - settings.tau) < 1e-9:
        return
    before, settings.tau = settings.tau, moved
    settings.notes.append(f"τ moved from {_tau_text(before)} to {_tau_text(settings.tau)} while the race waited: "
                          f"it ran at {_tau_text(settings.tau)}")


def _notes_text(settings: RaceSettings, name: str) -> str:
    text = "".join(f"\n\n✂ {n}" for n in settings.notes)
    advice = notices.race_notice(name, settings.prompt, settings.tau)
    return text + (f"\n\nℹ {advice}" if advice else "")


def _load_models(page: _Page, name: str, ar_name: str):
    """(lm, ar_lm); a line for each model that is not loaded yet while it loads."""
    for n in dict.fromkeys([name, ar_name]):
        if not models.is_loaded(n):
            yield page.show(f"Loading **{n}** …{models.loading_note(n) or ' ' + models.load_estimate(n)}")
        models.get_model(n)
    return models.get_model(name), models.get_model(ar_name)


def _stream_lanes(page: _Page, settings: RaceSettings, lanes: dict[str, _Lane], session: str,
                  superseded=lambda: False):
    """Race the decoders (app.race.race: the lane with the least compute so far runs the next forward); the page
    gets at most one update per YIELD_EVERY_S, and the τ slider steers the MARS lanes meanwhile. Raises
    _Superseded after the forward during which the page asked for a newer race."""
    controls = [lane.control for lane in lanes.values() if lane.control is not None]
    PAGES.steer(session, controls)
    try:
        words = {n: (token_texts(lane.lm), _decoder(lane.lm)) for n, lane in lanes.items()}
        slow = settings.slow_motion
        pace = None
        if slow > 1:
            yield page.show(f"◔ Timing each lane's forward without pauses, to pace slow motion ×{slow} …")
            pace = warm_costs(settings.prompt, lanes)
            for n in lanes:
                page.sides[n].slowed, page.sides[n].pace = slow, pace[n]
        racing = race(lanes={n: mars_core.generate_stream(lane.lm, [settings.prompt], lane.cfg,
                                                          tau_control=lane.control)
                             for n, lane in lanes.items()},
                      cost=None if pace is None else (lambda n, event: pace[n].of(event)))
        yield page.show("▶ Racing …")
        last = 0.0
        for n, event in racing:
            if superseded():
                raise _Superseded
            page.sides[n].add(event, *words[n])
            if pace is not None:
                time.sleep(max(0.0, slow * pace[n].of(event) - event.step_time))
            now = time.perf_counter()
            if now - last >= YIELD_EVERY_S:
                last = now
                yield page.show("▶ Racing …")
        for n in lanes:
            page.sides[n].finished = True
    finally:
        PAGES.release(session, controls)


def warm_costs(prompt: str, lanes: dict[str, _Lane], forwards: int = 6) -> dict[str, WarmCost]:
    """Each lane's warm forward time, for live slow motion to pace by.

    A forward that runs after a pause runs on a cold CPU (caches, idle cores): on a 2-core Xeon, after ×50
    pauses, smollm2-mars's forwards took 2-4× their time, unevenly between the lanes (AR ÷ MARS time 1.36
    where it is 1.94 without pauses), tiny-mars's up to 70×, and a pause proportional to the time it followed
    fed back on itself. Pacing by these cold times would race the lanes at a ratio that is not the machine's.
    So each lane decodes its first `forwards` forward passes back to back, twice (the first round warms up),
    at the race's starting τ, and the second round's times are its pace: slow motion ×f shows every forward
    for f × its warm time. A lane whose τ the slider moves is also timed at τ 1: ticking 'τ off' mid-race makes
    its forwards one-position ones, AR's cost, and pacing those by the masked time would slow it unfairly."""
    def timed(lm, cfg) -> tuple[float, float]:
        times = []
        for event in mars_core.generate_stream(lm, [prompt], cfg):
            times.append(event.step_time)
            if len(times) >= forwards or all(not r.active or r.done for r in event.rows):
                break
        later = sorted(times[1:]) or times
        return times[0], later[len(later) // 2]

    costs = {}
    for final in (False, True):
        for n, lane in lanes.items():
            prompt_s, step_s = timed(lane.lm, lane.cfg)
            one_s = None
            if lane.control is not None and lane.cfg.tau < 1.0:
                one_s = timed(lane.lm, dataclasses.replace(lane.cfg, tau=1.0))[1]
            if final:
                costs[n] = WarmCost(prompt_s, step_s, one_s)
    return costs


def biggest_chunk(side: SideRecord) -> tuple[str, int, int] | None:
    """(text, tokens, step) of the forward pass that committed the most tokens (the first such), or None: the
    answer to the page's "predict before you click" question."""
    if not side.steps:
        return None
    best = max(side.steps, key=lambda s: (len(s.token_ids), -s.step))
    return best.text, len(best.token_ids), best.step


def _summary(sides: dict[str, SideRecord], lanes) -> str:
    mars, verify = sides["mars"], sides["verify"]
    line = (f"MARS {mars.tokens_per_forward:.2f} tokens/forward ({mars.forwards} forwards)"
            + (f", MARS lossless {verify.tokens_per_forward:.2f} ({verify.forwards})" if "verify" in lanes else "")
            + f", AR {sides['ar'].forwards} forwards")
    big = biggest_chunk(mars)
    if big is not None and big[1] > 1:
        line += f". Most in one forward pass: «{big[0].strip() or big[0]}», {big[1]} tokens at step {big[2]}"
    return line


def _ran_tau_line(sides) -> str:
    parts = []
    for n in ("mars", "verify"):
        s = sides[n]
        if s.steps:
            parts.append(f"{s.label} τ = {tau_summary(s.taus)}")
    return "ran at " + " · ".join(parts) if parts else ""


def _time_again(page: _Page, settings: RaceSettings, lanes: dict[str, _Lane], summary: str, tau_line: str,
                give_way, turn: Turn):
    """Time the lanes' decoders again (app.timing), each repeat's numbers shown as they arrive; returns the
    measurements. `give_way()` true (a newer race, another job waiting) ends the repeats early. The repeats run
    in a thread (`turn.in_thread`): one repeat computes for seconds without a yield, and a closed page ends
    it at its next forward pass."""
    if give_way():
        return {}
    prompt_ids = lanes["mars"].lm.encode(settings.prompt)
    runs = {n: lane.rerun(prompt_ids, page.sides[n].taus) for n, lane in lanes.items()}

    def repeats(stop):
        with stop_at_forward([lane.lm for lane in lanes.values()], stop):
            return (yield from timing.measure_iter(page.sides, runs, lanes["ar"].lm, lanes["mars"].lm, prompt_ids,
                                                   settings.block_size, stop=give_way))

    # the line last shown, repeated while a repeat runs: until the first repeat ends it still says the timing runs
    status = [f"✓ Race finished: {summary}. {TIMING_STARTS}"]

    def show(progress):
        msg, so_far = progress
        status[0] = f"✓ Race finished: {summary}. {msg}"
        return page.show(status[0], measured=so_far or None, measuring=msg, tau_line=tau_line)
    # idle repeats the status line itself, not gr.skip(): an API client reads every output's status as text
    return (yield from turn.in_thread(repeats, "race-timing").relay(show, idle=lambda: _status_only(status[0])))


def _decoder(lm):
    def decode(ids):
        return lm.tokenizer.decode(ids, skip_special_tokens=True)
    return decode


LEDGER_LANES = {"MARS": "mars", "MARS lossless": "verify", "AR": "ar"}   # the ledger's lane choices


def _lane_of(side) -> str:
    return LEDGER_LANES.get(side, side if side in LANES else "mars")


def show_ledger(race_state, side, step):
    if not race_state:
        return render_ledger(SideRecord("MARS", "mars"), 0)
    return render_ledger(race_state[_lane_of(side)], int(step or 0))


def ledger_side_changed(race_state, side):
    """Switching lanes resets the step slider to that lane's range."""
    if not race_state:
        return gr.update(), show_ledger(race_state, side, 0)
    rec = race_state[_lane_of(side)]
    return (gr.update(minimum=0, maximum=max(1, rec.forwards - 1), value=0, interactive=rec.forwards > 1),
            render_ledger(rec, 0))


def examples_for(choice, free_text="", resolver: models.Resolver = models.BUILTINS):
    prompts = models.example_prompts(resolver.resolve_or_typed(choice, free_text))
    return gr.update(choices=prompts, value=None)


def _all_examples() -> set[str]:
    out = set(models.GENERAL_PROMPTS)
    for n in models.builtin_names():
        out.update(models.example_prompts(n))
    return out


def examples_and_prompt(choice, free_text="", prompt="", resolver: models.Resolver = models.BUILTINS):
    """Model changed: its example prompts, and the prompt replaced by its first example while the prompt is
    empty or an example of another model (the user's own text stays)."""
    prompts = models.example_prompts(resolver.resolve_or_typed(choice, free_text))
    cur = (prompt or "").strip()
    replace = prompts and cur not in prompts and (not cur or cur in _all_examples())
    shown = prompts[0] if replace else cur if cur in prompts else None   # the list shows the prompt it holds
    return gr.update(choices=prompts, value=shown), (gr.update(value=prompts[0]) if replace else gr.skip())


def use_example(example, prompt):
    """An example picked from the list becomes the prompt; emptying the list keeps the prompt."""
    return example or prompt


def take_offer(offered):
    """'Switch model' pressed: the picker moves to the offered model, and that counts as the user's own pick."""
    return gr.update(value=offered), True


def show_seed(temperature):
    """The seed field is shown only while sampling (temperature > 0)."""
    try:
        sampling = float(temperature) > 0
    except (TypeError, ValueError):
        sampling = False
    return gr.update(visible=sampling)


def teaching_note_update(choice, free_text="", resolver: models.Resolver = models.BUILTINS):
    """The 'what you are seeing' note of the picked model, hidden when it has none."""
    try:
        text = notices.teaching_note(resolver.resolve(choice, free_text))
    except Exception:   # a bad model name has its own message in the model status line
        text = ""
    return gr.update(value=text, visible=bool(text))


def notice_update(choice, free_text="", prompt="", tau=0.9, tau_off=False, resolver: models.Resolver = models.BUILTINS):
    """(notice, 'switch model' button, 'τ off' button, offered model) for the page; hidden when nothing applies."""
    try:
        name = resolver.resolve(choice, free_text)
        t = effective_tau(tau, tau_off, [])
    except Exception:   # a bad model name or τ has its own message elsewhere
        return gr.update(value="", visible=False), gr.update(visible=False), gr.update(visible=False), None
    text, offer, off = notices.notice(name, prompt, t)
    show_model = bool(text) and offer is not None and offer != name
    return (gr.update(value=text, visible=bool(text)),
            gr.update(visible=show_model, value=f"Switch to {offer}" if offer else "Switch model"),
            gr.update(visible=bool(text) and off), offer if show_model else None)


PREPARE_POLL_S = 2.0  # how often the page asks about the background model (gr.Timer in ui.py)


def poll_default_model(choice, free_text="", picked=False, resolver: models.Resolver = models.BUILTINS):
    """Timer tick / page load: the background model's status line, and the switch to it once it is ready.

    Returns (status markdown, picker update, examples update, timer update, switch-button update). The picker
    moves to smollm2-mars only when it is ready and the user has touched nothing (`picked`: set by the picker's
    input event, and by typing in or picking for the prompt, so a prompt typed meanwhile is never replaced) and
    the free field is empty; the examples follow it. When the user has touched something, a button offers the
    switch instead. The timer stops once nothing is left to wait for (ready, failed, not available, never
    started).
    """
    st = models.prepare_status()
    target = models.PREPARER.name
    stop = gr.Timer(active=False)
    hidden = gr.update(visible=False)
    if st["state"] == "preparing":
        return st["text"], gr.skip(), gr.skip(), gr.skip(), hidden
    if st["state"] != "ready":
        return st["text"], gr.skip(), gr.skip(), stop, hidden
    if (free_text or "").strip() or choice == target or target not in models.builtin_names():
        return st["text"], gr.skip(), gr.skip(), stop, hidden
    if picked:
        return st["text"], gr.skip(), gr.skip(), stop, gr.update(visible=True, value=f"Switch to {target}")
    return (st["text"], gr.update(choices=resolver.choices(), value=target),
            gr.update(choices=models.example_prompts(target), value=None), stop, hidden)
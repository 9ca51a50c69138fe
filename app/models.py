"""Which models the app may load, loading them once, and example prompts that suit each.

The picker offers the embedded models, smollm2-mars (SmolLM2 + the MARS LoRA in
assets/smollm2-mars, listed only when that folder holds an adapter), SmolLM2 (offline),
finished Finetune runs (addressed as "run:<name>", resolved inside the runs directory
only) and a free field: a local directory / .gguf file or a hub id the user types.
Loading itself is `mars_core.load_model`; this module only validates names and caches
results, and `PREPARER` builds and loads smollm2-mars in a background thread at app start
(its first build takes a while: docs/experiments/app-timing.md, "Load times"), so the page works on tiny-mars
meanwhile.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import mars_core
from mars_core.models import catalogue

# Every list below is read from mars_core.models.catalogue; the names stay because app code and tests import them.
# The picker's named models in catalogue order (the default first); adapters join them only when present.
BUILTIN_MODELS = [(r.label, r.name) for r in catalogue.models() if r.label is not None and not r.adapter]
# The MARS-trained real-language model: listed (first) only while its adapter folder exists.
SMOLLM2_MARS = catalogue.names(prompts=catalogue.NATURAL, mars=True)[0]
SMOLLM2_MARS_ENTRY = (catalogue.record(SMOLLM2_MARS).label, SMOLLM2_MARS)


def find_assets() -> Path:
    """mars_core.models.sources.find_assets, the same rule without importing mars_core.models.sources: that module
    imports torch and transformers (seconds of CPU: docs/experiments/app-timing.md, "How soon `python app.py` gives a
    usable page"), which the page's start no longer waits for (tests/test_app.py checks the two agree). $MARS_ASSETS if
    set; else the copy inside the installed package; else this checkout's."""
    if os.environ.get("MARS_ASSETS", "").strip():   # empty (or blank) counts as unset
        return Path(os.environ["MARS_ASSETS"]).expanduser().resolve()
    package = Path(mars_core.__file__).resolve().parent
    for path in (package / "assets", package.parent / "assets"):
        if path.is_dir():
            return path
    return package.parent / "assets"


SMOLLM2_MARS_DIR = find_assets() / SMOLLM2_MARS   # a checkout's assets/, an installed copy's, or $MARS_ASSETS
ADAPTER_FILES = ("adapter_config.json", "adapter.safetensors")  # what mars_core.models.sources.resolve_source requires
DEFAULT_MODEL = catalogue.DEFAULT_MODEL   # the page starts here
TASK_MODEL = catalogue.names(prompts=catalogue.TASKS, mars=True)[0]   # the MARS model trained on the task suite
FREE_TEXT_DEFAULT = SMOLLM2_MARS  # the default for free text once PREPARER has it ready
SAME_MODEL = "same"  # AR baseline = the selected checkpoint in one-token mode
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
TINY_MODELS = catalogue.names(kind=catalogue.TINY)
NATURAL_MODELS = catalogue.names(prompts=catalogue.NATURAL)  # real-language models: natural prompts
SMOLLM2_MODELS = catalogue.names(kind=catalogue.SMOLLM2)     # converted or merged once before their first load

GENERAL_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 12?",
]

# The real-language MARS model's teaching prompts: development prompts (held-out natural and structured prompts,
# seed 77, none in a report set) on which smollm2-mars's AR answer is correct, ends within the page's 112 tokens and
# does not loop (`python -m app.pick_examples`; most candidates failed that: a 135M model is often wrong). Each maps
# to the facts its AR answer must hold (tests/test_teaching.py), in every served format (fp32, w8a8, w8a16). With
# v3.1 at rank 128 the set leads with a sequence, where the masks guess most (about 2 tokens per forward), then code,
# a list and a one-sentence definition, where they guess least: the lesson is where MARS pays and where it does not.
# "Write a Python function that adds two numbers, and one example call." was dropped (in fp32 and w8a16 AR runs
# past the limit) and so was "Give a one-sentence definition of inertia." (1.05 tokens per forward in w8a8 at τ 0.95;
# the recycling definition, kept, 1.10–1.15 in the three formats). The sequence was "Write the multiples of 10 from 0
# to 100." until 2026-12-07: v3.5's own full fine-tune answers it wrongly, and only the rank-128 cut's error tipped
# that near tie to the right answer (every closer cut answered as the fine-tune). Its replacement, the one
# development enumeration whose AR answer is right and the same in the fine-tune, two cuts and the three formats, is
# the list below (docs/experiments/training-smollm2.md, "A sequence prompt that holds"). Check a candidate with
# `python -m finetune.evals.teaching --model DIR`.
TEACHING_FACTS: dict[str, tuple[str, ...]] = {
    "List the numbers from 10 to 30, separated by commas.": ("10, 11, 12", "28, 29, 30"),
    "Write a Python function that adds two numbers.": ("def ", "return", "+"),
    "Give three facts about sleep as a numbered list.": ("1.", "2.", "3.", "health"),
    "Define recycling in one sentence.": ("recycling", "materials"),
}
TEACHING_PROMPTS = list(TEACHING_FACTS)

# The τ the page starts each model at. tiny-mars: 0.9, where its answers on the task suite stay AR's.
# smollm2-mars (v3.6): 0.97, where its lossy answers to every teaching prompt are AR's in fp32, w8a8 and w8a16 and, on
# the 352 development prompts it was chosen on, 91% of its answers are AR's and one loops, at 1.36 tokens per forward
# (v3.5's cut there: 91%, 2 loops, 1.34; docs/experiments/training-smollm2.md, "v3.6: halfway between v3.5 and its
# second round").
DEFAULT_TAUS: dict[str, float] = {"smollm2-mars": 0.97}
DEFAULT_TAU = 0.9


def default_tau(name: str) -> float:
    """The τ the race starts at for `name` (DEFAULT_TAUS, else 0.9)."""
    return DEFAULT_TAUS.get(name, DEFAULT_TAU)


# The block size the race starts each model at. smollm2-mars: B = 3 (two masks). On 23 development prompts at τ 0.97
# (w8a8, one thread, thread clock) v3.5's cut (the folder before v3.6) ran its lossy lane 1.25× AR with two masks
# against 1.23× with three and 1.25× with one (the rank-128 cut before it: 1.31×, 1.26×, 1.21×): a forward with two
# masks cost 1.11× AR's, one with three 1.17×, and the third mask adds few tokens (docs/experiments/training-smollm2.md,
# "The page's block size"). B stays a slider.
DEFAULT_BLOCK_SIZES: dict[str, int] = {"smollm2-mars": 3}
DEFAULT_BLOCK_SIZE = 4


def default_block_size(name: str) -> int:
    """The block size B the race starts at for `name` (DEFAULT_BLOCK_SIZES, else 4)."""
    return DEFAULT_BLOCK_SIZES.get(name, DEFAULT_BLOCK_SIZE)


_cache: dict[str, object] = {}
_lock = threading.Lock()                    # guards _name_locks
_name_locks: dict[str, threading.Lock] = {}  # one per model: loading one never blocks another


def smollm2_mars_available() -> bool:
    """Whether assets/smollm2-mars holds an adapter (cheap: two file checks, no torch import)."""
    return all((SMOLLM2_MARS_DIR / f).is_file() for f in ADAPTER_FILES)


def builtin_models() -> list[tuple[str, str]]:
    """The named models of the picker: smollm2-mars first when its adapter exists, then BUILTIN_MODELS."""
    return ([SMOLLM2_MARS_ENTRY] if smollm2_mars_available() else []) + list(BUILTIN_MODELS)


def builtin_names() -> list[str]:
    return [v for _, v in builtin_models()]


# A tenth of the Finetune tab's default run (600 steps; docs/experiments/app-timing.md, "The app's default Finetune
# run"): a run stopped before this has hardly
# moved from its base, so the picker says so rather than let it pass for a trained model.
BARELY_TRAINED_STEPS = 60


class Resolver:
    """The page's one answer to "which model is this choice?": a built-in name, a typed path or hub id, or a
    finished Finetune run ("run:<name>", found by `runs`, a JobManager; None refuses runs). build_ui makes one
    for its page; a handler resolves the page's choice once and hands the resolved name or path on."""

    def __init__(self, runs=None):
        self.runs = runs

    def choices(self) -> list[tuple[str, str]]:
        """(label, value) pairs for the picker, the one source of its labels (at page load and every refresh);
        finished runs come last, newest first, a barely trained one saying so."""
        choices = builtin_models()
        if self.runs is not None:
            for name, _path in self.runs.finished_checkpoints():
                step = self.runs.status(name).get("step")
                barely = (f" ⚠ barely trained: {step} step{'' if step == 1 else 's'}"
                          if step is not None and step < BARELY_TRAINED_STEPS else "")
                choices.append((f"run: {name} (your finetune){barely}", f"run:{name}"))
        return choices

    def resolve(self, choice: str, free_text: str = "") -> str:
        """The name or path to hand to mars_core.load_model; ValueError for anything not allowed.

        A typed path must exist (a transformers directory or a .gguf file); a typed hub id
        must look like owner/name. Runs resolve only to checkpoints inside the runs directory.
        """
        if not isinstance(choice, (str, type(None))) or not isinstance(free_text, (str, type(None))):
            raise ValueError(f"the model is {choice!r} / {free_text!r}: pick a name from the list, or type a path "
                             "or hub id")
        free_text = (free_text or "").strip()
        if free_text:
            return _typed_model(free_text)
        if not choice:
            raise ValueError("pick a model from the list or type a path / hub id")
        if choice.startswith("run:"):
            if self.runs is None:
                raise ValueError("finetune runs are not available in this app")
            return self.runs.checkpoint_for(choice[4:])
        known = builtin_names()
        if choice == SMOLLM2_MARS and choice not in known:
            raise ValueError(f"{SMOLLM2_MARS} is not available: its adapter is missing in assets/{SMOLLM2_MARS} "
                             f"(build it with `python -m finetune.recipes.recipe_smollm2`)")
        if choice not in known:
            raise ValueError(f"model {choice!r} is not in the list {', '.join(known)}; type other paths in the "
                             "free field")
        return choice

    def resolve_or_typed(self, choice, free_text="") -> str:
        """The resolved model, or (for a choice that does not resolve) the text as typed: for the example prompts,
        which suit a name even when it cannot be loaded."""
        try:
            return self.resolve(choice or DEFAULT_MODEL, free_text)
        except ValueError:
            return (free_text or "").strip() or choice or DEFAULT_MODEL

    def task_model(self, choice: str, free_text: str = "", picked: bool = True) -> str:
        """The model for the task-suite parts (the explorer's built-in sweep, the Learn step).

        The user's choice when they picked one (picker or free field); otherwise tiny-mars, the model
        trained on the task suite, even after the picker switched itself to smollm2-mars for free text.
        """
        if not picked and not (free_text or "").strip():
            return TASK_MODEL
        return self.resolve(choice, free_text)


def _typed_model(free_text: str) -> str:
    """A path or hub id from the free field, checked (see Resolver.resolve)."""
    if len(free_text) > 300 or any(c in free_text for c in "\n\r\0"):
        raise ValueError("the model field holds a path or hub id of at most 300 characters on one line")
    path = Path(free_text).expanduser()
    if path.exists():
        if path.is_dir() and (path / "config.json").exists():
            return str(path.resolve())
        if path.is_file() and path.suffix == ".gguf":
            return str(path.resolve())
        raise ValueError(f"{free_text!r} is neither a transformers directory (with config.json) nor a .gguf file")
    if free_text.startswith(("/", ".", "~")) or "\\" in free_text:
        raise ValueError(f"path {free_text!r} does not exist; type an existing directory or .gguf file")
    if not HUB_ID_RE.match(free_text):
        raise ValueError(f"{free_text!r} is not a local path or a hub id like 'owner/model'")
    return free_text


# Without a page (launch's preload, the tests): built-in names, paths and hub ids; runs are refused.
BUILTINS = Resolver()
resolve, model_choices, task_model = BUILTINS.resolve, BUILTINS.choices, BUILTINS.task_model


def is_loaded(name: str) -> bool:
    return name in _cache


def get_model(name: str):
    """mars_core.load_model(name), loaded once per server process (thread-safe, one lock per model)."""
    lm = _cache.get(name)
    if lm is not None:
        return lm
    with _lock:
        lock = _name_locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _cache:
            from mars_core import load_model
            lm = load_model(name)
            warm_up(lm)
            _cache[name] = lm
        return _cache[name]


def warm_up(lm) -> None:
    """One short decode in each mode, so one-off start-up costs do not land on either side of a race."""
    from mars_core import DecodeConfig, generate
    for mode in ("ar", "mars"):
        generate(lm, ["Hi"], DecodeConfig(mode=mode, max_new_tokens=4))


def load_with_timing(name: str):
    t0 = time.perf_counter()
    lm = get_model(name)
    return lm, time.perf_counter() - t0


# The weight formats in words a class can read; the short name stays in brackets for whoever looks it up.
FORMAT_WORDS = {"float32": "32-bit floats", "bfloat16": "16-bit floats (bf16)", "float16": "16-bit floats (fp16)",
                "int8": "8-bit integer weights (int8)", "w8a8": "8-bit integers (w8a8)",
                "w8a16": "8-bit weights, 16-bit activations (w8a16)"}


def describe(lm) -> str:
    """The model line of the page, in plain words and short: on a projector a second line pushes the race down."""
    n_params = getattr(lm, "n_params", 0) or sum(p.numel() for p in lm.model.parameters())
    fmt = getattr(lm, "weight_format", None)
    device = "on the CPU" if lm.device.type == "cpu" else f"on {lm.device}"
    computes = "" if fmt is None else f" in {FORMAT_WORDS.get(fmt, fmt)}"
    return f"**{lm.name}** · {n_params / 1e6:.1f} M parameters · runs {device}{computes} · mask token id {lm.mask_id}"


def friendly_error(exc: BaseException) -> str:
    """One readable line for the page: never a stack trace."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return first or type(exc).__name__
    if isinstance(exc, OSError) and ("connect" in first.lower() or "offline" in first.lower()
                                      or "resolve" in first.lower() or "hub" in first.lower()):
        return f"could not fetch the model (this machine is offline?): {first[:300]}"
    return f"{type(exc).__name__}: {first[:300]}"


def _trained_on_builtin(name: str) -> bool:
    """A model (resolved: a run is its checkpoint folder) from finetune.train on the built-in suite (its
    train_config.json says data = builtin)."""
    import json
    try:
        return json.loads((Path(name) / "train_config.json").read_text()).get("data") == "builtin"
    except (OSError, ValueError, AttributeError):
        return False


def example_prompts(name: str, n: int = 6) -> list[str]:
    """Prompts that suit the model (resolved, see Resolver): held-out task prompts for the tiny models and anything
    trained on the built-in suite; for the real-language models (smollm2-mars, smollm2) a few curated general
    prompts (first, for a MARS-trained one, TEACHING_PROMPTS) followed by natural held-out prompts
    (`finetune.evals.natural`: subjects no training prompt mentions); general prompts otherwise."""
    if name in TINY_MODELS or (name not in NATURAL_MODELS and _trained_on_builtin(name)):
        try:
            from finetune.tasks import make_examples
            examples = make_examples("heldout", n, seed=0)
            return [ex["messages"][0]["content"] for ex in examples]
        except Exception:  # finetune.tasks missing or broken: fall back to general prompts
            pass
    if name in NATURAL_MODELS:
        curated = [GENERAL_PROMPTS[0], GENERAL_PROMPTS[2], GENERAL_PROMPTS[3]]
        if name in catalogue.names(prompts=catalogue.NATURAL, mars=True):   # where MARS shows several tokens
            curated = TEACHING_PROMPTS + curated
        try:
            from finetune.evals.natural import natural_prompts
            return list(dict.fromkeys(curated + natural_prompts("heldout", n, seed=0)))
        except Exception:  # finetune.evals.natural missing or broken: the general prompts still suit the model
            pass
    return list(GENERAL_PROMPTS)


# ----------------------------------------------------------------------------- background preparation
PREPARE_ESTIMATE = "first start on this machine: the time is measured now and shown from the next start"
TIMES_FILE = "app-start-times.json"   # in the model cache: what the background preparation took on this machine


def _times_path() -> Path:
    """mars_core.engine.cache.cache_dir's rule without importing it (it imports torch): MARS_CACHE_DIR, else
    ~/.cache/mars-playground (tests/test_app.py keeps the two equal)."""
    value = os.environ.get("MARS_CACHE_DIR", "")
    return (Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "mars-playground") / TIMES_FILE


def measured_times() -> dict:
    """{"build_s", "load_s"} as last measured on this machine ({} when never, or unreadable)."""
    try:
        data = json.loads(_times_path().read_text(encoding="utf-8"))
        return {k: float(v) for k, v in data.items() if k in ("build_s", "load_s")}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _record_time(key: str, seconds: float) -> None:
    """Keep what a stage took here, for the next start's promise (a failure to write only loses the promise)."""
    try:
        from mars_core.models.storage import atomic_write_text

        times = measured_times()
        times[key] = round(seconds, 1)
        _times_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_times_path(), json.dumps(times))
    except Exception:
        pass


class BackgroundPreparer:
    """Builds (mars_core.models.sources.prepare) and loads (get_model, warm) one model in a daemon thread.

    States: "idle" (not started), "not-available" (its assets are missing), "preparing", "ready",
    "failed" (with a one-line reason). `status()` is cheap and safe to call from any thread.
    """

    def __init__(self, name: str = SMOLLM2_MARS, available=None):
        self.name = name
        self._available = available or (lambda: smollm2_mars_available())  # looked up at call time
        self._lock = threading.Lock()
        self.state = "idle"
        self.first_start: bool | None = None   # None until known: True = the slow one-time build runs
        self.error = ""
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.thread: threading.Thread | None = None
        self.stage = ""   # what the thread does now: waiting, building, loading

    def start(self, wait_for: threading.Event | None = None, log=None, wait_limit_s: float = 300.0) -> bool:
        """Start the thread (once); False when the model is not available. The thread waits for
        `wait_for` first (the start-up model's preload), so that model gets the CPU first."""
        with self._lock:
            if self.thread is not None or self.state in ("preparing", "ready"):
                return True
            if not self._available():
                self.state = "not-available"
                return False
            self.state, self.error, self.first_start = "preparing", "", None
            self.started_at, self.finished_at = time.monotonic(), None
            self.thread = threading.Thread(target=self._run, args=(wait_for, log, wait_limit_s), daemon=True,
                                           name=f"prepare-{self.name}")
        self.thread.start()
        return True

    def _run(self, wait_for, log, wait_limit_s) -> None:
        try:
            if wait_for is not None:
                self.stage = "waiting"
                wait_for.wait(wait_limit_s)
            from mars_core.models import sources
            first = not sources.is_prepared(self.name)
            with self._lock:
                self.first_start = first
            if first:
                self.stage, t0 = "building", time.monotonic()
                sources.prepare(self.name)   # the slow one-time build, cached on disk
                _record_time("build_s", time.monotonic() - t0)
            self.stage, t0 = "loading", time.monotonic()
            get_model(self.name)             # load and warm up: a race on it starts at once
            _record_time("load_s", time.monotonic() - t0)
            with self._lock:
                self.state, self.finished_at = "ready", time.monotonic()
            if log:
                log(f"{self.name} ready ({self.finished_at - self.started_at:.1f} s)")
        except Exception as exc:   # never a traceback: one line on the page, the app stays on tiny-mars
            with self._lock:
                self.state, self.error, self.finished_at = "failed", friendly_error(exc), time.monotonic()
            if log:
                log(f"{self.name} unavailable: {self.error} (free text stays on {TASK_MODEL})")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread (tests); True when it has finished."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def status(self) -> dict:
        """{"state", "elapsed_s", "error", "text"}: text is the one status line for the page."""
        with self._lock:
            state, error, first = self.state, self.error, self.first_start
            t0, t1 = self.started_at, self.finished_at
        if state == "idle" and not self._available():
            state = "not-available"
        elapsed = 0.0 if t0 is None else (t1 if t1 is not None else time.monotonic()) - t0
        name = self.name
        if state == "preparing":
            text = f"◷ {name}: {self._stage_text(first)} — {elapsed:.0f} s so far; the page works meanwhile"
        elif state == "ready":
            text = f"✓ {name} ready (took {elapsed:.0f} s): the default model for free text"
        elif state == "failed":
            text = f"⚠ {name} failed: {error} — free text stays on {TASK_MODEL}"
        elif state == "not-available":
            text = (f"{name} is not available here (no adapter in assets/{name}; "
                    f"`python -m finetune.recipes.recipe_smollm2` builds it): free text runs on {TASK_MODEL}")
        else:
            text = ""
        return {"state": state, "elapsed_s": elapsed, "error": error, "text": text}


    def _stage_text(self, first: bool | None) -> str:
        """The stage, with a time only where this machine measured one before (never a promise it did not keep)."""
        times = measured_times()
        stage = self.stage or "waiting"
        if stage == "waiting" or first is None:
            return "waiting for the start-up model to load first"
        if stage == "building":
            took = times.get("build_s")
            when = f"took {took:.0f} s here last time" if took else PREPARE_ESTIMATE
            return f"preparing once: converting the GGUF and merging the adapter ({when})"
        took = times.get("load_s")
        when = f"took {took:.0f} s here last time" if took else "not measured on this machine yet"
        return f"loading and warming up ({when})"


PREPARER = BackgroundPreparer()


def start_background_prepare(wait_for: threading.Event | None = None, log=None) -> bool:
    """At app start: build and load smollm2-mars in the background when its adapter exists."""
    return PREPARER.start(wait_for=wait_for, log=log)


def prepare_status() -> dict:
    """The background model's state for the page to poll (see BackgroundPreparer.status)."""
    return PREPARER.status()


# What the page promises while a model loads; the load times behind them: docs/experiments/app-timing.md,
# "Load times".
LOAD_ESTIMATES = {"tiny": "(about 2 s)", "prepared": "(about 10-15 s on a small CPU)",
                  "build": "(the first load converts or merges the model once: 30-40 s, then about 10-15 s to load)"}


# The page is served before torch and transformers are imported (app.launch): the first model this process loads
# also waits for them (their import time on the project's 2-core CPU: docs/experiments/app-timing.md, "How soon
# `python app.py` gives a usable page").
LIBRARIES_ESTIMATE = "the first load also imports torch and transformers: about 5 s more"


def load_estimate(name: str) -> str:
    """An honest, parenthesised estimate of how long loading `name` takes here ('' when unknown)."""
    estimate = _model_estimate(name)
    if estimate and not _cache:   # no model loaded yet in this process: the libraries come first
        estimate = f"{estimate[:-1]}; {LIBRARIES_ESTIMATE})"
    return estimate


def _model_estimate(name: str) -> str:
    if name in TINY_MODELS:
        return LOAD_ESTIMATES["tiny"]
    if name in SMOLLM2_MODELS:
        try:
            from mars_core.models import sources
            return LOAD_ESTIMATES["prepared" if sources.is_prepared(name) else "build"]
        except Exception:
            return ""
    if HUB_ID_RE.match(name) and not Path(name).exists():
        return "(a hub model: downloaded first unless cached, then loaded; size decides how long)"
    return "(a local checkpoint: seconds for small models, longer for large ones)"


def loading_note(name: str) -> str:
    """' (preparing …)' while the background preparer is still building `name`, else ''."""
    st = PREPARER.status() if name == PREPARER.name else None
    if st and st["state"] == "preparing":
        return f" ({st['text'].removeprefix('◷ ').split(';')[0]})"
    return ""

"""What both suites of finetune.evals.evaluate share: batched decoding, the loop check, the model labels and the τ
curves.

A module of its own so that the natural suite (finetune.evals.evaluate_natural) and the task suite with the CLI
(finetune.evals.evaluate) can both use them without importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path

from mars_core.models.storage import atomic_write_text

ABLATION_DIR = "runs/tiny-mars-arw0"   # the ar_weight = 0 model the recipe trains; not committed


def decode_batches(lm, prompts: list[list[int]], cfg, batch_size: int):
    """`generate` over `prompts` in batches of `batch_size`: one result per prompt, in order."""
    from mars_core import generate

    out = []
    for i in range(0, len(prompts), batch_size):
        out.extend(generate(lm, prompts[i: i + batch_size], cfg))
    return out


def repeats_itself(ids: list[int], n: int = 8, times: int = 3) -> bool:
    """True when some run of `n` tokens occurs `times` times or more: a decoding loop, not an answer."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(ids) - n + 1):
        key = tuple(ids[i: i + n])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] >= times:
            return True
    return False


def mean_positions_per_forward(results) -> float | None:
    """Columns fed per forward after the prompt's, mean over sequences (at batch > 1 a forward's columns are the
    widest row's); None when no sequence took a second forward."""
    values = [r.positions_per_forward for r in results if r.positions_per_forward is not None]
    return sum(values) / len(values) if values else None


def curve_label(row: dict) -> str:
    """The model's name, with the confidence criterion appended when it is not the paper's (prob) and
    "lossless" for verify-mode rows."""
    criterion = row.get("criterion", "prob")
    label = row["model"] if criterion == "prob" else f"{row['model']} [{criterion}]"
    if row.get("mode") != "verify":
        return label
    extra = [row["draft_layout"]] if row.get("draft_layout", "linear") not in ("linear", None) else []
    extra += [f"lookup {row['prompt_lookup']}"] if row.get("prompt_lookup") else []
    return label + f" (lossless{', ' + ', '.join(extra) if extra else ''})"


def tau_curve(rows: list[dict], x_key: str, y_key: str, name: str, y_label: str, **style):
    """One τ curve: `rows` sorted by x, y in percent, points labelled by τ; rows without a y are left out."""
    import plotly.graph_objects as go

    pts = sorted((r for r in rows if r["tau"] != "ar" and r.get(y_key) is not None and r.get(x_key) is not None),
                 key=lambda r: r[x_key])
    if not pts:
        return None
    return go.Scatter(
        x=[r[x_key] for r in pts], y=[100 * r[y_key] for r in pts],
        mode="lines+markers+text", name=name, text=[f"τ={r['tau']:g}" for r in pts],
        textposition="top center",
        hovertemplate="%{text}<br>%{x:.2f} tokens/forward<br>" + y_label + " %{y:.1f}%<extra>" + name + "</extra>",
        **style,
    )


def model_label(args, i: int, m: str) -> str:
    """The rows' name of `args.models[i]` (`m`): its --names label, else the ablation's or the model's own name."""
    if args.names:
        return args.names[i]
    if Path(m).is_dir() and Path(m).resolve() == Path(ABLATION_DIR).resolve():
        return "tiny-mars ar_weight=0"
    return Path(m).name if Path(m).is_dir() else m


ROW_KEYS = ("model", "mode", "criterion", "draft_layout", "prompt_lookup", "tau")   # what tells two rows apart


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ROW_KEYS)


def read_rows(path: str | Path, label: str, fix: str) -> tuple[list[dict], bool]:
    """(rows, partial) of an evaluate --json file: the finished list, or a stopped run's {"partial": true,
    "rows": [...]}. A file that is neither is a ValueError naming `label` and saying `fix`."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label} cannot be read as evaluate rows ({e}): {fix}") from None
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return data["rows"], bool(data.get("partial"))
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return data, False
    raise ValueError(f"{label} holds no evaluate rows: {fix}")


class RowLog:
    """The rows of one evaluate run as they finish. With --json FILE every finished row is saved at once,
    atomically, as {"partial": true, "rows": [...]}, so a stop loses at most the row in progress; the finished
    run replaces it with the plain list of rows. `resume` reads a partial (or finished) FILE back: `done(key)`
    then gives the row an earlier run finished, and the sweep skips it."""

    def __init__(self, path: str | None, resume: bool = False):
        self.path = Path(path) if path not in (None, "-") else None
        self.rows: list[dict] = []
        self.total = 0
        self.finished: dict[tuple, dict] = {}
        if resume and self.path is None:
            raise ValueError("--resume continues the rows saved in --json FILE: give --json FILE as well")
        earlier = self._read()
        if earlier is not None and earlier[1] and not resume:
            raise ValueError(f"--json {str(self.path)!r} holds an interrupted run ({len(earlier[0])} finished rows): "
                             "add --resume to finish it, or remove the file to start over")
        if resume and earlier is not None:
            self.finished = {row_key(r): r for r in earlier[0]}

    def _read(self) -> tuple[list[dict], bool] | None:
        """(rows, partial) of an existing FILE; None when there is none."""
        if self.path is None or not self.path.is_file():
            return None
        return read_rows(self.path, f"--json {str(self.path)!r}", "remove it or pass another file")

    def check(self, **expected) -> None:
        """Refuse to resume rows measured with other settings (a row mixing them would mean nothing)."""
        for row in self.finished.values():
            for key, value in expected.items():
                if key in row and row[key] != value:
                    raise ValueError(f"--resume: {str(self.path)!r} was written with {key}={row[key]!r}, this run "
                                     f"has {value!r}: rerun with the same flags, or drop --resume")

    def done(self, key: tuple) -> dict | None:
        return self.finished.get(key)

    def add(self, rows: list[dict]) -> None:
        """Rows just finished (or taken over from the resumed file): keep them and save the partial file."""
        self.rows += rows
        if self.path is not None and rows:   # atomic: a full disk leaves the last good partial file, no temp file
            atomic_write_text(self.path, json.dumps({"partial": True, "rows": self.rows}, indent=1),
                              f"--json {self.path}")

    def interrupted(self) -> str:
        """How far the run got, for the one line a stop prints."""
        where = f"; the finished rows are in {str(self.path)!r} (flagged partial): rerun with --resume to finish" \
            if self.path is not None and self.rows else ""
        return f"after {len(self.rows)} of {self.total} rows{where}"

"""ONNX Runtime GenAI as a speed reference for `bench --onnxruntime`: greedy AR on int8 or int4 weights, one thread.

Optional and never a dependency: `pip install onnxruntime-genai onnx onnx_ir onnxscript`. ONNX Runtime's own
model builder turns a transformers checkpoint into an ONNX model whose products are MatMulNBits: 8-bit (or 4-bit)
weights in blocks of 32, each with a scale, and with accuracy_level=4 the activations quantized to int8 per block,
so the products run on int8 dot products (docs/experiments/cpu-speed-issue-27.md, "ONNX Runtime and torchao"). Without a
folder, bench builds one from the very checkpoint our sides load (smollm2-mars: the merged adapter), once, under
cache_dir()/onnxruntime: int8 by default, whose quality matches w8a16's; int4 is faster and loses quality.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HINT = "pip install onnxruntime-genai onnx onnx_ir onnxscript (not needed for anything but this comparison)"
PRECISIONS = ("int8", "int4")   # the weights' bits in the builds bench makes; the products are int8 in both


def available() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


def check_usable() -> None:
    """A ValueError naming the fix unless onnxruntime-genai is installed and imports."""
    if not available():
        raise ValueError(f"--onnxruntime needs onnxruntime-genai, which is not installed: {HINT}")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--onnxruntime: onnxruntime-genai is installed but does not import ({e}): {HINT}") from None


def check_folder(folder: str | Path) -> None:
    """A ValueError naming the fix unless `folder` holds a model ONNX Runtime GenAI's builder wrote."""
    if not (Path(folder) / "genai_config.json").is_file():
        raise ValueError(f"--onnxruntime {str(folder)!r} is not an ONNX Runtime GenAI model folder (no "
                         f"genai_config.json): pass one its model builder wrote, or {' or '.join(PRECISIONS)} to "
                         "build one")


def wants_build(choice: str) -> bool:
    """Whether `--onnxruntime CHOICE` names a precision to build rather than a folder."""
    return choice in PRECISIONS and not Path(choice).is_dir()


def build(checkpoint: str | Path, precision: str = "int8") -> Path:
    """The ONNX model of a transformers checkpoint folder with `precision` weights (PRECISIONS) and int8 products
    (MatMulNBits accuracy_level 4), built once under cache_dir()/onnxruntime (offline, written to a temporary folder
    first, so a half-built model never looks complete)."""
    from mars_core.engine.cache import cache_dir

    if precision not in PRECISIONS:
        raise ValueError(f"--onnxruntime {precision!r}: build int8 or int4, or pass a model folder")
    checkpoint = Path(checkpoint)
    target = cache_dir() / "onnxruntime" / f"{checkpoint.name}-{precision}"
    if (target / "genai_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out, work = Path(tmp) / "model", Path(tmp) / "work"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                               "-o", str(out), "-c", str(work), "-p", precision, "-e", "cpu",
                               "--extra_options", "int4_accuracy_level=4"], env=env, capture_output=True, text=True)
        if done.returncode != 0 or not (out / "genai_config.json").is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise ValueError(f"--onnxruntime: ONNX Runtime's model builder failed on {checkpoint} ({last}): pass a "
                             f"folder it built, --onnxruntime DIR")
        os.replace(out, target)
    return target


def _with_threads(folder: Path, threads: int, into: Path) -> Path:
    """A view of `folder` (links to its files) whose genai_config.json runs `threads` threads; `folder` is untouched."""
    for f in folder.iterdir():
        if f.name != "genai_config.json":
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.update({"intra_op_num_threads": threads, "inter_op_num_threads": 1})
    (into / "genai_config.json").write_text(json.dumps(config, indent=2))
    return into


class OrtGenAIAR:
    """Greedy decoding of token-id prompts with ONNX Runtime GenAI on `threads` threads; one prompt at a time."""

    def __init__(self, folder: str | Path, eos_ids: list[int], threads: int = 1):
        check_usable()
        folder = Path(folder)
        check_folder(folder)
        import onnxruntime_genai as og

        self._view = tempfile.TemporaryDirectory(prefix="mars-ort-")
        self.model = og.Model(str(_with_threads(folder, threads, Path(self._view.name))))
        self._og, self.eos = og, set(eos_ids)
        self.label = f"onnxruntime-genai ({folder.name}, {threads} thread)"
        self.device = torch.device("cpu")   # what bench's timer syncs on

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt_ids) + max_new_tokens, do_sample=False, min_length=0)
        generator = self._og.Generator(self.model, params)
        generator.append_tokens(prompt_ids)
        out: list[int] = []
        while not generator.is_done() and len(out) < max_new_tokens:
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            out.append(token)
            if token in self.eos:
                break
        return out

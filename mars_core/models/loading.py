"""Model loading: `load_model` for every kind of source, and `wrap_model` for a model already in memory.

Everything returns a `LoadedModel`: the model in eval mode, its tokenizer, the resolved `mask_id`
(docs/algorithm.md, "Tokens") and every end-of-turn id. Which folder a name means, and the one-time GGUF
conversion and adapter merge, are mars_core.models.sources'; the chat template, mask id and end-of-turn ids are
mars_core.models.tokens'. Nothing here downloads unless the user names a hub id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from mars_core.models.adapter import is_gated, read_adapter_config
from mars_core.engine.cpu_layout import cpu_decoding_layout
from mars_core.models.formats import (ACT_QUANTIZED, BACKENDS, W8A8_KEEPS_QUALITY, auto_cpu_format, lean_net,
                                      pick_backend, pick_dtype)
from mars_core.models.sources import (
    DEFAULT_MODEL, _checkpoint_dir, _first_line, _from_pretrained, _model_name, _stock_config, resolve_source,
)
from mars_core.models.tokens import encode_chat, end_of_turn_ids, resolve_mask_id


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    eos_ids: list[int]
    path: str
    name: str
    device: torch.device
    mask_source: str = "tokenizer"  # how mask_id was found: tokenizer | spare-row | reused:<token>
    context_length: int = field(default=0)
    # What the decoder runs: `model` itself (backend "hf") or a mars_core.engine.lean.LeanLM built from it ("lean").
    # `model` stays the transformers model for generate(), training and export (in dtype="int8"/"w8a8" its linear
    # layers are quantized the same way, so that generate() runs the same format).
    net: object = field(default=None, repr=False)
    n_params: int = 0   # the float model's parameter count (quantized layers hide theirs inside packed weights)
    row_costs: list | None = None   # relative forward cost by positions fed, once measured (draft_layout="auto")

    def __post_init__(self):
        if self.net is None:
            self.net = self.model
        if not self.n_params:
            self.n_params = sum(p.numel() for p in self.model.parameters())

    @property
    def backend(self) -> str:
        return "hf" if self.net is self.model else "lean"

    @property
    def weight_format(self) -> str:
        """"w8a8", "w8a16", "int8", or the float dtype the decoder computes in: what tells two loads of one model
        apart."""
        from mars_core.engine.int8 import Int8Linear
        from mars_core.engine.w8a8 import WIDE, W8A8Linear

        fmt = getattr(self.net, "format", None)
        if fmt in ("int8", "w8a8"):
            return "w8a16" if getattr(self.net, "kernel", None) == WIDE else fmt
        for m in self.model.modules():
            if isinstance(m, (Int8Linear, W8A8Linear)):
                return "int8" if isinstance(m, Int8Linear) else "w8a16" if m.kernel == WIDE else "w8a8"
        return str(getattr(self.net, "dtype", None) or self.model.dtype).replace("torch.", "")

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for one user prompt, through the chat template unless `chat=False`."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt={prompt!r} has type {type(prompt).__name__}, not str: pass the prompt as text")
        if not prompt.strip():
            raise ValueError(f"prompt={prompt!r} is empty: type a question or instruction for the model")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:   # lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
            raise ValueError(f"the prompt is not valid UTF-8 text (character {e.start} is {prompt[e.start]!r}): "
                             "pass UTF-8 text") from None
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = encode_chat(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:   # raw text is text too: a typed "<|im_end|>" is characters, not the control token
            ids = tok(prompt, split_special_tokens=True)["input_ids"]
        if len(ids) + 2 > self.context_length:
            raise ValueError(
                f"the prompt is {len(ids)} tokens but {self.name} has a context of {self.context_length}: "
                "shorten the prompt"
            )
        return list(ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ----------------------------------------------------------------------------- devices

def pick_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device torch knows: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is visible: use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible: "
                         f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cpu", "cuda"):
        backend = getattr(torch, dev.type, None)
        if not (hasattr(backend, "is_available") and backend.is_available()):
            raise ValueError(f"device={device!r} is not available on this machine: use auto, cpu or cuda")
    return dev


# ----------------------------------------------------------------------------- checkpoints

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")


def _load_tokenizer(where: str):
    """The checkpoint's tokenizer; a folder without tokenizer files, or damaged ones, is named with the fix."""
    folder = Path(where)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the "
                         "tokenizer next to the weights (tokenizer.save_pretrained(folder)) "
                         "or copy it from the base model")
    try:
        return AutoTokenizer.from_pretrained(where)
    except Exception as exc:
        raise ValueError(f"{where}: the tokenizer could not be loaded ({_first_line(exc)}): restore its tokenizer "
                         "files (tokenizer.json, tokenizer_config.json) from the base model") from None


def _load_weights(where: str, config, dtype: torch.dtype, **kwargs):
    """_from_pretrained, with missing or damaged weight files named instead of a loader traceback."""
    try:
        return _from_pretrained(where, config, dtype, **kwargs)
    except ValueError:
        raise
    except Exception as exc:   # no weights file, truncated safetensors, wrong shapes
        raise ValueError(f"{where}: the model weights could not be read ({_first_line(exc)}): the weights file "
                         "(model.safetensors) is missing or damaged; restore or re-save the checkpoint") from None


def load_model(name_or_path: str | None = None, *, device: str = "auto", dtype: str = "auto",
               mask_token: str | None = None, cpu_layout: bool = True, backend: str = "auto") -> LoadedModel:
    """Load a model for decoding. `None` loads the embedded default (tiny-mars).

    An adapter (smollm2-mars, or a folder with adapter_config.json) is merged into its base once and the
    merged folder loaded; its mask token is the one it was trained with. A gated adapter (mars-gated-lora-v1) is
    never merged: the base is loaded and the adapter applied at mask positions only (mars_core.engine.gated), so real
    tokens run the base model exactly; dtype="auto" serves it in float32 on a CPU.
    On a CPU the linear layers are stored transposed for faster few-row GEMMs (`cpu_decoding_layout`);
    `cpu_layout=False` keeps the stock modules. `dtype="int8"` (CPU only) stores the linear weights as int8
    with a scale per row and computes in bf16 where the CPU has native bf16, else fp32 (`mars_core.engine.int8`);
    `dtype="w8a8"` (CPU only) also quantizes the activations, per row (`mars_core.engine.w8a8`); `dtype="w8a16"`
    (CPU with AVX2) to int16 levels in one pass, on our AVX2 kernel.
    `backend`: what the decoder runs (`LoadedModel.net`): "lean" (mars_core.engine.lean, Llama-family only), "hf" (the
    transformers model) or "auto" (lean on a CPU where the architecture allows, else hf).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use auto, hf or lean")
    name_or_path = _model_name(name_or_path)   # a Path works as its text
    kind, where = resolve_source(name_or_path)
    adapter = _Adapter.of(kind, where, name_or_path, mask_token, dtype, backend)
    dev = pick_device(device)   # cheap checks before any conversion or loading
    torch_dtype = pick_dtype(dtype, dev)
    where = _checkpoint_dir(kind, where, name_or_path)
    config = _stock_config(where)
    tokenizer = _load_tokenizer(where)
    quantized = dtype in ("int8",) + ACT_QUANTIZED   # weights rounded once, from fp32
    model = _load_weights(where, config, torch.float32 if quantized else torch_dtype, attn_implementation="sdpa")
    if adapter.gated:   # before any change of layout or format, which keep the wrappers (mars_core.engine.gated)
        from mars_core.models.adapter import attach_gated

        attach_gated(model, adapter.folder)
    model.to(dev).eval()
    n_params = sum(p.numel() for p in model.parameters())
    lean = pick_backend(backend, model, dev) == "lean" and not (adapter.gated and dtype == "w8a8"
                                                                and not adapter.native_gate)
    float_gate = adapter.gated and not adapter.native_gate   # no lean w8a8 forward for the gate
    source = (name_or_path or DEFAULT_MODEL, str(where))
    net = _serve(model, tokenizer, source, dtype, dev, lean, float_gate, cpu_layout)
    mask_id, source = resolve_mask_id(tokenizer, model, adapter.mask_token)
    if adapter.config is not None and mask_id != adapter.config["mask_id"]:
        raise ValueError(f"{name_or_path!r}: {adapter.mask_token!r} is id {mask_id} in the base tokenizer but the "
                         f"adapter was trained with mask_id={adapter.config['mask_id']}: it belongs to another base; "
                         "rebuild it")
    return LoadedModel(
        model=model, tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path=str(where), name=name_or_path or DEFAULT_MODEL, device=dev, mask_source=source,
        context_length=getattr(config, "max_position_embeddings", 2048), net=net, n_params=n_params,
    )


@dataclass
class _Adapter:
    """What an adapter source changes in a load: its folder and config (None: not an adapter), the mask token it
    was trained with, whether it is gated, and whether our kernels' native stack applies the gate."""
    folder: str | None = None
    config: dict | None = None
    mask_token: str | None = None
    gated: bool = False
    native_gate: bool = False

    @classmethod
    def of(cls, kind: str, where: str, name: str, mask_token: str | None, dtype: str, backend: str) -> "_Adapter":
        if kind != "adapter":
            return cls(mask_token=mask_token)
        cfg = read_adapter_config(where)
        if mask_token is not None and mask_token != cfg["mask_token"]:
            raise ValueError(f"mask_token={mask_token!r} but {name!r} was trained with "
                             f"{cfg['mask_token']!r}: leave mask_token unset for an adapter")
        gated = is_gated(cfg)
        # the lean w8a8 forward applies a gated adapter in our own kernels' native stack only (asked only where
        # w8a8 may run: finding the kernel can mean building it)
        may_w8a8 = dtype == "w8a8" or (dtype == "auto" and (name or DEFAULT_MODEL) in W8A8_KEEPS_QUALITY)
        # w8a16 runs only on our AVX2 kernel (pick_dtype refuses it where that is missing), which has the stack
        native_gate = gated and (dtype == "w8a16" or (may_w8a8 and _own_w8a8_kernel()))
        if gated and dtype == "w8a8" and backend == "lean" and not native_gate:
            raise ValueError(f"{name!r} is a gated adapter, which the lean w8a8 forward applies only with our "
                             "own w8a8 kernels (not available here): use backend='hf' (or auto) with w8a8, or dtype "
                             "float32, bfloat16 or int8")
        return cls(where, cfg, cfg["mask_token"], gated, native_gate)


def _serve(model, tokenizer, source: tuple[str, str], dtype: str, dev, lean: bool, float_gate: bool,
           cpu_layout: bool):
    """Put the loaded model in the format it decodes in; returns the lean forward (None: the decoder runs the
    transformers model). dtype="auto" on a CPU picks the fastest exact format (formats.auto_cpu_format) for
    `source` (name, folder), float32 for a gated adapter whose gate only float runs (`float_gate`)."""
    net, torch_dtype = None, pick_dtype(dtype, dev)
    if dev.type == "cpu" and dtype == "auto" and float_gate:
        dtype = "float32"
    elif dev.type == "cpu" and dtype == "auto":
        dtype, net = auto_cpu_format(model, tokenizer, *source, lean)
        torch_dtype = pick_dtype(dtype, dev)
    if lean and net is None:
        net = lean_net(model, dtype, torch_dtype, tokenizer)
    if dtype == "int8":   # the transformers model in the same format, for generate() and backend="hf"
        from mars_core.engine.int8 import quantize_int8

        quantize_int8(model, torch_dtype)
        model.to(torch_dtype)
    elif dtype in ACT_QUANTIZED:
        from mars_core.engine.w8a8 import WIDE, quantize_w8a8

        quantize_w8a8(model, WIDE if dtype == "w8a16" else None)
    elif dev.type == "cpu" and cpu_layout:
        cpu_decoding_layout(model)
    return net


def wrap_model(model, tokenizer, name: str = "in-memory", mask_token: str | None = None,
               backend: str = "hf") -> LoadedModel:
    """A LoadedModel around objects already in memory (tests, training evaluation); `backend="lean"` decodes
    through a LeanLM built from `model` in its own dtype."""
    mask_id, source = resolve_mask_id(tokenizer, model, mask_token)
    device = next(model.parameters()).device
    net = lean_net(model, "float", model.dtype) if pick_backend(backend, model, device) == "lean" else None
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path="", name=name, device=device, mask_source=source,
        context_length=getattr(model.config, "max_position_embeddings", 2048), net=net,
    )


def _own_w8a8_kernel() -> bool:
    """Whether w8a8 runs on one of our own kernels here (mars_core.engine.w8a8.OWN), whose native layer stack applies a
    gated adapter's deltas."""
    from mars_core.engine.w8a8 import OWN, pick_kernel

    return pick_kernel() in OWN

"""MARS decoding as a transformers `custom_generate` method.

    model.generate(input_ids, custom_generate="<this repo's folder or its hub copy>", trust_remote_code=True,
                   tau=0.95, block_size=4, mask_token_id=<id>, max_new_tokens=64)

transformers calls `generate(model=..., **the arguments of model.generate)`; this function hands the prompt ids
to the decoder in mars_step.py (mars_core's, the same code as `python -m mars_core generate`, copied there by
`python -m mars_core.tools.vendor_custom_generate`) and returns what `generate` returns:
the sequences tensor, or with `return_dict_in_generate=True` an output whose `sequences` come with the
accepted tokens of every forward pass. See README.md next to this file.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

# Relative: transformers copies a custom_generate folder's relatively imported files next to generate.py (from
# a local folder or the Hub), so the decoder travels with this file and `mars_core` need not be installed.
from .mars_step import DecodeConfig, generate_stream

DEFAULT_NEW_TOKENS = 20   # what plain `generate` produces when neither max_new_tokens nor max_length is set

# generation-config settings MARS decoding does not implement, with the values that mean "off"
_UNSUPPORTED = {
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "min_length": (None, 0), "min_new_tokens": (None, 0),
    "bad_words_ids": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "output_scores": (None, False),
    "output_logits": (None, False), "output_attentions": (None, False), "output_hidden_states": (None, False),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "min_p": (None,),
    "penalty_alpha": (None,), "guidance_scale": (None, 1.0), "prompt_lookup_num_tokens": (None,),
    "watermarking_config": (None,), "sequence_bias": (None,), "renormalize_logits": (None, False),
}
# arguments of `model.generate` itself that MARS decoding does not implement
_UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                     "negative_prompt_ids", "negative_prompt_attention_mask")
_IGNORED = ("synced_gpus", "use_cache", "use_model_defaults")   # no meaning for this decoder (it always caches)


@dataclass
class MarsGenerateOutput(ModelOutput):
    """`return_dict_in_generate=True`: the sequences plus what each forward pass accepted.

    sequences: [batch, prompt + new] like plain generate (rows that stopped early padded with pad_token_id).
    accepted_counts: per row, the number of tokens each forward pass accepted (sum = that row's new tokens).
    step_tokens: per row, the accepted ids of each forward pass.
    finish_reasons: per row, "eos", "length" or "stop".
    """
    sequences: torch.LongTensor | None = None
    accepted_counts: list | None = None
    step_tokens: list | None = None
    finish_reasons: list | None = None


class _ModelView:
    """What the decoder reads from a loaded model (mars_core's LoadedModel), built from a bare transformers model."""

    def __init__(self, model, tokenizer, mask_id: int, eos_ids: list[int], context_length: int):
        self.model, self.tokenizer = model, tokenizer
        self.mask_id, self.eos_ids, self.context_length = mask_id, eos_ids, context_length
        self.device = model.device
        self.name = getattr(model.config, "name_or_path", "") or type(model).__name__
        self.path = self.name

    def encode(self, prompt, chat=True):
        raise ValueError("custom_generate decodes token ids: tokenize the prompt yourself and pass input_ids")

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _prompt_rows(input_ids: torch.Tensor, attention_mask) -> list[list[int]]:
    """Each row's real tokens; left padding (pad tokens first, attention_mask 0) is stripped."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: pass a [batch, length] tensor of token ids")
    if attention_mask is None:
        return input_ids.tolist()
    mask = attention_mask.to(torch.long).cpu()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}: "
                         "pass the mask the tokenizer returned with these ids")
    rows = []
    for r, (ids, m) in enumerate(zip(input_ids.tolist(), mask.tolist())):
        n = sum(m)
        if n == 0:
            raise ValueError(f"row {r} of attention_mask is all zeros: every prompt needs at least one token")
        if m != [0] * (len(m) - n) + [1] * n:
            raise ValueError(f"row {r} of attention_mask is not left-padded ({m}): MARS decoding needs the pads "
                             "first; set tokenizer.padding_side = 'left' before tokenizing the batch")
        rows.append(ids[len(m) - n:])
    return rows


def _mask_id(model, tokenizer, explicit, tau: float) -> int:
    if explicit is None:
        explicit = getattr(model.config, "mask_token_id", None)     # what `python -m mars_core export` writes
    if explicit is None and tokenizer is not None:
        explicit = getattr(tokenizer, "mask_token_id", None)
    rows = model.get_input_embeddings().weight.shape[0]
    if explicit is None:
        if tau >= 1.0:
            return 0   # one-token mode appends no masks; the id only fills the decoder's invisible holes
        raise ValueError("no mask token id: pass mask_token_id=<the id the model was MARS-trained with> (or a "
                         "tokenizer with a mask token, or export the model with `python -m mars_core export`, "
                         "which writes mask_token_id into its config)")
    if not isinstance(explicit, int) or not 0 <= explicit < rows:
        raise ValueError(f"mask_token_id={explicit!r} is not a token id of this model (0 .. {rows - 1}): pass the "
                         "id of its mask token")
    return explicit


def generate(model, inputs=None, generation_config: GenerationConfig | None = None, streamer=None, *,
             mode: str = "mars", tau: float = 0.95, block_size: int | None = None, mask_token_id: int | None = None,
             criterion: str = "prob", max_accept: int | None = None, tokenizer=None, **kwargs):
    """Run MARS decoding on `model`; arguments as `model.generate`, plus:

    mode: "mars" (keep confident predictions as they come: fastest, can differ from greedy at tau < 1) or
          "verify" (lossless: confident predictions are drafts that the next forward checks; greedy only).
    tau: acceptance (verify: drafting) threshold; >= 1 is one-token mode, token for token plain greedy decoding.
    block_size: B, the candidates of one forward pass; default: model.config.mars_block_size (an export's), else 4.
    mask_token_id: the mask token's id; default: model.config.mask_token_id, else tokenizer.mask_token_id.
    criterion: prob | entropy | margin (what must reach tau). max_accept: cap on tokens kept per forward.
    tokenizer: only for stop_strings (and the text of streamed steps).
    """
    input_ids, rows, gen, cfg = _intake(model, inputs, generation_config, kwargs, mode=mode, tau=tau,
                                        block_size=block_size, criterion=criterion, max_accept=max_accept,
                                        tokenizer=tokenizer)
    eos_ids = _as_list(gen.eos_token_id)
    lm = _model_view(model, tokenizer, _mask_id(model, tokenizer, mask_token_id, cfg.tau), eos_ids)
    if streamer is not None and len(rows) > 1:
        raise ValueError("a streamer takes one sequence: rows accept different numbers of tokens per forward, "
                         "so stream a batch of 1")
    steps, reasons = _decode(lm, input_ids, rows, cfg, streamer)
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    return _output(input_ids, steps, reasons, pad_id, gen.return_dict_in_generate)


# ----------------------------------------------------------------------------- intake: arguments -> what to decode

def _intake(model, inputs, generation_config, kwargs: dict, *, mode, tau, block_size, criterion, max_accept,
            tokenizer):
    """Check every argument before any forward: (input_ids, each row's prompt ids, the generation config, the
    DecodeConfig). Every refusal names the setting and the fix."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("MARS decoding is for decoder-only causal LMs; this model is an encoder-decoder")
    input_ids, attention_mask = _prompt_arguments(inputs, kwargs)
    gen = _generation_config(model, generation_config, kwargs)
    rows = _prompt_rows(input_ids, attention_mask)
    max_new = _max_new_tokens(gen, input_ids.shape[1])
    sampling = bool(gen.do_sample)
    if sampling and gen.top_k not in (None, 0):
        raise ValueError(f"top_k={gen.top_k!r} is not supported by MARS sampling (temperature and top_p are): "
                         "pass top_k=0")
    if block_size is None:
        block_size = getattr(model.config, "mars_block_size", None) or 4
    if mode not in ("mars", "verify"):
        raise ValueError(f"mode={mode!r} is unknown: use 'mars' or 'verify' (lossless); for AR use plain generate")
    cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=max_new,
                       temperature=(gen.temperature if gen.temperature is not None else 1.0) if sampling else 0.0,
                       top_p=gen.top_p if sampling and gen.top_p is not None else 1.0, criterion=criterion,
                       max_accept=max_accept, stop_strings=tuple(_stop_strings(gen.stop_strings, tokenizer)))
    return input_ids, rows, gen, cfg


def _prompt_arguments(inputs, kwargs: dict):
    """(input_ids, attention_mask) taken out of `kwargs`, with `generate` arguments MARS has no use for."""
    input_ids = kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("pass the prompt once: as the first argument or as input_ids=, not both")
    input_ids = inputs if inputs is not None else input_ids
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("input_ids is missing: pass the tokenized prompt(s) as a [batch, length] LongTensor")
    attention_mask = kwargs.pop("attention_mask", None)
    for name in _UNSUPPORTED_ARGS:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name} is not supported by MARS decoding: leave it unset (or use plain generate)")
    for name in _IGNORED:
        kwargs.pop(name, None)
    return input_ids, attention_mask


def _generation_config(model, generation_config, kwargs: dict) -> GenerationConfig:
    """The model's (or the given) generation config with the remaining kwargs applied; settings MARS does not
    implement, and names generate does not know, are refused."""
    gen = copy.deepcopy(generation_config or model.generation_config)   # never change the model's own
    unknown = gen.update(**kwargs)
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)} for MARS generate: it takes generate()'s "
                         "generation settings plus tau, block_size, mask_token_id, criterion, max_accept, tokenizer")
    for name, off in _UNSUPPORTED.items():
        value = getattr(gen, name, None)
        if value not in off:
            raise ValueError(f"{name}={value!r} is not supported by MARS decoding: pass {name}={off[-1]!r}")
    return gen


def _max_new_tokens(gen: GenerationConfig, length: int) -> int:
    if gen.max_new_tokens is not None:
        max_new = gen.max_new_tokens
    elif gen.max_length is not None:
        max_new = gen.max_length - length
    else:
        max_new = DEFAULT_NEW_TOKENS
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new_tokens={max_new!r} (from max_length={gen.max_length!r} and a prompt of {length}) "
                         "leaves nothing to generate: pass max_new_tokens >= 1")
    return max_new


def _model_view(model, tokenizer, mask_id: int, eos_ids: list[int]) -> _ModelView:
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    # No eos configured: -1 is an id no token has, so the decoder never stops early (as plain generate).
    return _ModelView(model, tokenizer, mask_id, eos_ids or [-1], int(context) if context else 1 << 30)


# ----------------------------------------------------------------------------- decode and output

def _decode(lm: _ModelView, input_ids: torch.Tensor, rows: list[list[int]], cfg: DecodeConfig, streamer):
    """Run the decoder: (per row, the accepted ids of each forward pass; per row, its finish reason). The
    streamer gets the prompt, then row 0's accepted ids of each pass, then `end`."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    steps = [[] for _ in rows]
    reasons = ["length" for _ in rows]
    for event in generate_stream(lm, rows, cfg):
        for r, row in enumerate(event.rows):
            if row.active:
                steps[r].append(list(row.accepted_ids))
                reasons[r] = row.finish_reason or reasons[r]
        if streamer is not None and event.rows[0].accepted_ids:
            streamer.put(torch.tensor(event.rows[0].accepted_ids))
    if streamer is not None:
        streamer.end()
    return steps, reasons


def _output(input_ids: torch.Tensor, steps: list, reasons: list[str], pad_id: int, as_dict: bool):
    """What `generate` returns: [batch, prompt + new] sequences, rows that stopped early padded with pad_id; with
    return_dict_in_generate the per-pass steps as well."""
    new = [[t for s in row_steps for t in s] for row_steps in steps]
    width = max(len(n) for n in new)
    tail = torch.full((len(new), width), pad_id, dtype=input_ids.dtype)
    for r, n in enumerate(new):
        tail[r, : len(n)] = torch.tensor(n, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
    if as_dict:
        return MarsGenerateOutput(sequences=sequences, accepted_counts=[[len(s) for s in row] for row in steps],
                                  step_tokens=steps, finish_reasons=reasons)
    return sequences


def _stop_strings(stops, tokenizer) -> list[str]:
    if not stops:
        return []
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer to read the text: pass tokenizer=<your tokenizer>")
    return [stops] if isinstance(stops, str) else list(stops)

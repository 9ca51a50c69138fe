"""What a finetune.train run trains: the base model, LoRA, the trainable mask row, the loss-computing wrapper,
the optimizer, and the ``Run`` that the loop (finetune.train) and checkpoints (finetune.checkpoint) share.

A module of its own so that finetune.checkpoint can name these types without importing finetune.train, which
imports it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from finetune.config import TrainConfig
from finetune.data import Example
from finetune.losses import MarsLossSettings, ar_loss, mars_loss

# ----------------------------------------------------------------------------- model loading


@dataclass
class Base:
    """The starting model and what the loss needs to know about its tokenizer."""

    model: nn.Module
    tokenizer: object
    mask_id: int
    eos_ids: list[int]
    path: str


def load_base(name: str) -> Base:
    """Load ``name`` through mars_core (names, dirs, GGUF; mask id per docs/algorithm.md) in fp32 on CPU."""
    from mars_core import load_model

    lm = load_model(name, device="cpu", dtype="float32", cpu_layout=False)   # stock modules: trained and saved
    return Base(lm.model, lm.tokenizer, lm.mask_id, list(lm.eos_ids), lm.path)


def load_anchor(name: str, lm: nn.Module) -> nn.Module:
    """The frozen model of --ar-anchor, refused unless its vocabulary is ``lm``'s (the KL compares token by token)."""
    anchor = load_base(name).model.eval().requires_grad_(False)
    ours, theirs = lm.get_output_embeddings().weight.shape[0], anchor.get_output_embeddings().weight.shape[0]
    if ours != theirs:
        raise ValueError(f"ar_anchor={name!r} has a {theirs}-token vocabulary, the trained model {ours}: anchor it "
                         "to a model with the same tokenizer (its base model)")
    return anchor


def add_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = "all-linear"   # every projection in attention and MLP; not the LM head
    if cfg.lora_layers:
        n = model.config.num_hidden_layers
        if cfg.lora_layers > n:
            raise ValueError(f"lora_layers={cfg.lora_layers} but {cfg.base_model} has {n} decoder layers: "
                             f"use 1..{n}, or 0 for every layer")
        top = tuple(f".layers.{i}." for i in range(n - cfg.lora_layers, n))
        targets = [name for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and any(t in name for t in top)]
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def prepare_model(model: nn.Module, cfg: TrainConfig, state: dict | None, init: "WarmStart | None" = None) -> nn.Module:
    """fp32, training mode, no KV cache; with --lora the adapter around it: a resumed run's saved one, else the
    --init-adapter's (``init``), else a fresh one."""
    model.float().train()
    model.set_attn_implementation(cfg.attention)   # the losses pass eager an additive mask (finetune.losses)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.gradient_checkpointing:
        # Non-reentrant: it needs no input that requires a gradient (a LoRA run's embeddings are frozen), and it
        # re-runs FSDP2's gather hooks when a layer is recomputed. The losses call model.model directly; its
        # layers honour the flag in training mode.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora:
        model = add_lora(model, cfg)
        if state is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, state["lora"])
        elif init is not None:
            init.load_into(model)
    return model


# ----------------------------------------------------------------------------- warm start (--init-adapter)


def same_base(a: str, b: str) -> bool:
    """Two --base-model values name the same model: equal text, or paths to the same existing file or folder."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


@dataclass
class WarmStart:
    """A MARS adapter to start from (mars-lora-v1; mars-gated-lora-v1 for a --gated-lora run): checked against the
    run's settings when read (before any model is loaded) and against the model's shapes when loaded (before the
    first step)."""

    path: str
    config: dict
    modules: dict       # {module path: (A [r, in], B [out, r])}
    mask_row: torch.Tensor | None

    @classmethod
    def read(cls, cfg: TrainConfig) -> "WarmStart":
        from mars_core.models.adapter import is_gated, read_adapter

        path = cfg.init_adapter
        if not Path(path).expanduser().is_dir():
            raise ValueError(f"--init-adapter {path!r} is not a folder: pass an adapter folder such as "
                             "assets/smollm2-mars (adapter.safetensors + adapter_config.json)")
        config, modules, mask_row = read_adapter(Path(path).expanduser())
        if config.get("ranks"):   # peft's LoRA of one --lora-r cannot hold matrices of different ranks
            raise ValueError(f"--init-adapter {path!r} has a rank per matrix (a full fine-tune's export): continue it "
                             f"as a full fine-tune from the merged model (--base-model {path}, without --lora)")
        if is_gated(config) != cfg.gated_lora:   # a delta trained at masks only must stay there, and vice versa
            theirs, fix = (("gated", "pass --gated-lora") if is_gated(config)
                           else ("plain (merged)", "drop --gated-lora"))
            raise ValueError(f"--init-adapter {path!r} is a {theirs} adapter but this run is "
                             f"{'gated' if cfg.gated_lora else 'not gated'}: {fix}, or start without --init-adapter")
        wants = [("base", config["base"], cfg.base_model, "--base-model"),
                 ("r", config["r"], cfg.lora_r, "--lora-r"), ("alpha", config["alpha"], cfg.lora_alpha, "--lora-alpha"),
                 ("block_size", config["block_size"], cfg.block_size, "--block-size")]
        for key, theirs, ours, flag in wants:
            same = same_base(theirs, ours) if key == "base" else theirs == ours
            if not same:
                raise ValueError(f"--init-adapter {path!r} has {key}={theirs!r} but this run has {flag} {ours!r}: "
                                 f"pass {flag} {theirs}, or start without --init-adapter")
        if mask_row is not None and not cfg.train_mask_row:
            raise ValueError(f"--init-adapter {path!r} holds a trained mask row: pass --train-mask-row (a run "
                             "without it would neither train nor save that row)")
        return cls(path, config, modules, mask_row)

    def check_model(self, peft_model: nn.Module, mask_id: int) -> dict:
        """{module path: LoRA layer} of ``peft_model``, refusing another base: other modules, shapes or mask id."""
        from peft.tuners.lora import LoraLayer

        layers = {name: m for name, m in peft_model.get_base_model().named_modules() if isinstance(m, LoraLayer)}
        where = f"--init-adapter {self.path!r}"
        if set(layers) != set(self.modules):
            extra, missing = sorted(set(self.modules) - set(layers)), sorted(set(layers) - set(self.modules))
            raise ValueError(f"{where} adapts other modules than this model's LoRA layers (only in the adapter: "
                             f"{extra[:2]}, only in the model: {missing[:2]}): it was made for another base than "
                             f"{self.config['base']!r}'s architecture, or with other target modules")
        for name, (a, b) in self.modules.items():
            want_a, want_b = layers[name].lora_A["default"].weight.shape, layers[name].lora_B["default"].weight.shape
            if a.shape != want_a or b.shape != want_b:
                raise ValueError(f"{where}: {name} has lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                                 "but this model's "
                                 f"are {list(want_a)} / {list(want_b)}: the adapter was made for another base")
        if self.config["mask_id"] != mask_id:
            raise ValueError(f"{where} was trained with mask id {self.config['mask_id']} "
                             f"but this model's is {mask_id}: "
                             "it was made for another tokenizer")
        hidden = peft_model.get_base_model().get_input_embeddings().weight.shape[1]
        if self.mask_row is not None and self.mask_row.shape[0] != hidden:
            raise ValueError(f"{where}: its mask row has {self.mask_row.shape[0]} values, this model's hidden size is "
                             f"{hidden}: it was made for another base")
        return layers

    @torch.no_grad()
    def load_into(self, peft_model: nn.Module) -> None:
        """Copy A and B into the fresh LoRA layers (fp32). The scale alpha / r is the run's, equal to the adapter's."""
        for name, layer in self.check_model(peft_model, self.config["mask_id"]).items():
            a, b = self.modules[name]
            layer.lora_A["default"].weight.copy_(a.float())
            layer.lora_B["default"].weight.copy_(b.float())


# ----------------------------------------------------------------------------- the trained module


class MaskRow(nn.Module):
    """The mask token's embedding as one trainable vector (``--train-mask-row``).

    Forward hooks put it in place of the embedding's row wherever the input holds ``mask_id`` and, when the
    LM head is tied to the embedding, in place of the head's logit column for ``mask_id``, so training sees
    exactly the model that ``write_into`` produces at save time.
    """

    def __init__(self, lm: nn.Module, mask_id: int):
        super().__init__()
        embedding = lm.get_input_embeddings()
        self.mask_id = mask_id
        self.row = nn.Parameter(embedding.weight[mask_id].detach().float().clone())
        embedding.register_forward_hook(self._embed)
        head = lm.get_output_embeddings()
        self.tied = head is not None and head.weight is embedding.weight
        if self.tied:
            head.register_forward_hook(self._head)

    def _embed(self, module, args, output):
        hit = (args[0] == self.mask_id).unsqueeze(-1)
        return torch.where(hit, self.row.to(output.dtype), output)

    def _head(self, module, args, output):
        column = args[0] @ self.row.to(args[0].dtype)
        output = output.clone()
        output[..., self.mask_id] = column.to(output.dtype)
        return output

    @torch.no_grad()
    def write_into(self, lm: nn.Module) -> None:
        """Store the row in ``lm``'s embedding matrix (and so in a tied LM head): a plain checkpoint."""
        lm.get_input_embeddings().weight[self.mask_id] = self.row.to(lm.get_input_embeddings().weight.dtype)


class MaskGate:
    """--gated-lora: every LoRA delta is multiplied by (input token == mask_id), so real tokens run the base model.

    A hook on the input embedding reads the ids of each forward (training's [noisy | clean] or a decoding step's
    [tokens | masks]) and hooks on the LoRA B projections apply the gate, position by position. Nothing but a
    forward through the input ids may run the model (an inputs_embeds call would meet a stale gate: refused)."""

    def __init__(self, lm: nn.Module, mask_id: int):
        from peft.tuners.lora import LoraLayer

        self.mask_id, self.gate = mask_id, None
        lm.get_input_embeddings().register_forward_hook(self._read_ids)
        self.n_gated = 0
        for module in lm.modules():
            if isinstance(module, LoraLayer):
                for b in module.lora_B.values():
                    b.register_forward_hook(self._apply)
                    self.n_gated += 1
        assert self.n_gated, "gated_lora found no LoRA layer to gate"

    def _read_ids(self, module, args, output):
        self.gate = (args[0] == self.mask_id).unsqueeze(-1)  # [b, L, 1]

    def _apply(self, module, args, output):
        assert self.gate is not None and self.gate.shape[:-1] == output.shape[:-1], \
            "gated LoRA saw a forward without its input ids"
        return output * self.gate.to(output.dtype)


class TrainModule(nn.Module):
    """Wraps the LM so that the loss runs inside ``forward``.

    Data-parallel gradient sync hooks in at the wrapper's forward; the losses call
    ``model.model`` and ``model.lm_head`` directly (logits on labelled rows only),
    so they must run inside the module that accelerate wraps.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, mask_id: int):
        super().__init__()
        self.model = model
        self.stage, self.block_size, self.ar_weight, self.mask_id = cfg.stage, cfg.block_size, cfg.ar_weight, mask_id
        self.mask_label_smoothing = cfg.mask_label_smoothing
        self.soft_target_weight, self.soft_target_top_k = cfg.soft_target_weight, cfg.soft_target_top_k
        self.mask_row = MaskRow(self.causal_lm(), mask_id) if cfg.train_mask_row else None
        self.gate = MaskGate(self.causal_lm(), mask_id) if cfg.gated_lora else None
        self.anchor_weight = cfg.ar_anchor_weight if cfg.ar_anchor else 0.0
        # A tuple, not a submodule: the frozen anchor stays out of parameters(), state_dict() and any sharding.
        self._anchor = (load_anchor(cfg.ar_anchor, self.causal_lm()),) if cfg.ar_anchor else ()

    def causal_lm(self) -> nn.Module:
        """The transformers model (with LoRA layers injected in place when training LoRA)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids, labels, valid, block_offset: int = 0):
        lm = self.causal_lm()
        if self.stage == "mars":
            settings = MarsLossSettings(
                block_size=self.block_size, mask_id=self.mask_id, ar_weight=self.ar_weight,
                mask_label_smoothing=self.mask_label_smoothing, block_offset=block_offset,
                soft_weight=self.soft_target_weight, soft_top_k=self.soft_target_top_k,
                # gated: the clean stream holds no mask token, so it is the base model and needs no backward pass
                frozen_clean=self.gate is not None, anchor_weight=self.anchor_weight,
            )
            anchor = self._anchor[0].to(input_ids.device) if self._anchor else None
            return mars_loss(lm, input_ids, labels, valid, settings, anchor)
        return ar_loss(lm, input_ids, labels, valid)


def wrap_model(model: nn.Module, cfg: TrainConfig, mask_id: int, state: dict | None,
               init: WarmStart | None = None) -> TrainModule:
    """The TrainModule around ``model``: a resumed run's mask row restored (else the --init-adapter's), --compile
    applied."""
    module = TrainModule(model, cfg, mask_id)
    row = state["mask_row"] if state is not None else init.mask_row if init is not None else None
    if row is not None and module.mask_row is not None:
        with torch.no_grad():
            module.mask_row.row.copy_(row)
    if cfg.compile:
        # Only the decoder's forward: the loss's row gathering has data-dependent shapes.
        decoder = module.causal_lm().model
        decoder.forward = torch.compile(decoder.forward, dynamic=True)
    return module


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on 1-D parameters (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), foreach=True)


# ----------------------------------------------------------------------------- the run


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it after each optimizer step. A second signal aborts at once."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def install(self):
        self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def uninstall(self):
        for sig, handler in getattr(self, "previous", {}).items():
            signal.signal(sig, handler)

    def handle(self, signum, frame):
        if self.requested:
            # Abort with the signal actually received: run_main maps Terminated to 143, KeyboardInterrupt to 130.
            from mars_core.decode.config import Terminated

            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.requested = True
        self.signal_name = signal.Signals(signum).name


@dataclass
class Run:
    """Everything ``fit`` needs; built by ``setup`` (both in finetune.train)."""

    cfg: TrainConfig
    accelerator: object
    module: nn.Module  # prepared TrainModule (DDP-wrapped when data-parallel)
    optimizer: torch.optim.Optimizer
    tokenizer: object
    examples: list[Example]
    pad_id: int
    out: Path
    total_steps: int
    micro_per_epoch: int
    start_step: int = 0
    elapsed_before: float = 0.0  # training seconds spent in earlier (resumed) sessions
    resumed_from: str | None = None
    stop: StopFlag = field(default_factory=StopFlag)
    manifest: tuple[list[str], list] | None = None   # (prompt keys, sources) of data_manifest.json

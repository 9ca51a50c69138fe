"""``--sharding full``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) for finetune.train.

Data parallelism (``--sharding no``, accelerate's DDP) keeps the whole model, its gradients and the two Adam
moments in every process: about 16 bytes a parameter before activations. Full sharding splits all three over
the N processes (each keeps 1/N of every parameter as a DTensor shard) and gathers one decoder layer's
parameters at a time for its forward and backward, so a step holds the shards plus about one layer in full.

One code path for CPUs and GPUs: accelerate still starts the process group (gloo on CPU processes, nccl on GPUs,
whichever ``uses_cpu`` chose) and moves the batches; this module only shards the TrainModule, replacing
``accelerator.prepare`` for it. accelerate's own FSDP plugin is not used because on CPU processes it falls back
to DDP or one process, so what it would run on GPUs could not be tested here.

Units: one per decoder layer, then the root (the TrainModule: embeddings, final norm, LM head, the mask row),
whose parameters stay gathered between its forward and backward. The MARS loss calls ``lm.model`` and
``lm.lm_head`` inside the TrainModule's forward, so every parameter is gathered where it is used.
``--mixed-precision bf16`` becomes FSDP2's ``MixedPrecisionPolicy``: bf16 compute and gathers, fp32 gradient
reduction and fp32 shards for AdamW.

Checkpoints: each ``checkpoint-<step>/`` keeps its ordinary layout (the consolidated full model, LoRA merged,
that the decoder and the app load) and adds ``sharded/``, a ``torch.distributed.checkpoint`` folder with every
process's shard of the trainable parameters and their Adam state; a resume loads that (the same process count
only: it sets the global batch and so the data order).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from finetune.config import TrainConfig

SHARDED_DIR = "sharded"   # the torch.distributed.checkpoint folder inside checkpoint-<step>/
# What trainer_state.pt holds under "optimizer" for a sharded run: the state itself is in SHARDED_DIR
SHARDED_OPTIMIZER = {"torch.distributed.checkpoint": SHARDED_DIR}


def is_sharded(cfg: TrainConfig) -> bool:
    return cfg.sharding != "no"


def check_world(cfg: TrainConfig) -> None:
    """Refuse --sharding full in a single process, before anything slow: there is nothing to shard over."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if is_sharded(cfg) and world < 2:
        raise ValueError(f"--sharding {cfg.sharding} splits the model over processes but this run has {world}: launch "
                         "it with `torchrun --nproc_per_node N -m finetune.train ...` (N >= 2), or use --sharding no")


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (Llama, Qwen2, SmolLM2: ``lm.model.layers``)."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"--sharding full shards one unit per decoder layer but {type(lm).__name__} has no "
                         "model.layers: use --sharding no for this model")
    return layers


def shard(module: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Apply fully_shard to every decoder layer of ``module`` (a TrainModule), then to ``module`` itself."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if cfg.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for layer in decoder_layers(module.causal_lm()):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


def prepare(accelerator, module: nn.Module, cfg: TrainConfig, make_optimizer) -> tuple[nn.Module, object]:
    """(module, optimizer) ready to train: sharded with its optimizer over the shards, or accelerate's DDP."""
    if not is_sharded(cfg):
        return accelerator.prepare(module, make_optimizer(module, cfg))
    module = shard(module, cfg, accelerator.device)
    return module, make_optimizer(module, cfg)   # built over the DTensor shards: each process steps its own


def no_sync(accelerator, module: nn.Module, sync: bool):
    """The context of one micro-batch's backward: gradients are reduced across processes only when ``sync``."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(module, "set_requires_gradient_sync"):   # an FSDP2 module has no DDP-style no_sync
        return _fsdp_no_sync(module)
    return accelerator.no_sync(module)


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def full_value(tensor):
    """A DTensor's whole value (the gradient norm of sharded gradients is one); anything else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ----------------------------------------------------------------------------- checkpoints

def _options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (a LoRA run's base, --freeze-embeddings) are the base model's: a resume reloads them.
    return StateDictOptions(ignore_frozen_params=True, **extra)


def save_sharded(module: nn.Module, optimizer, directory: Path) -> None:
    """Every process writes its shard of the trainable parameters and their optimizer state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer, options=_options())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / SHARDED_DIR))


def load_sharded(module: nn.Module, optimizer, checkpoint: Path) -> None:
    """Restore what ``save_sharded`` wrote into the sharded module and its optimizer (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer, options=_options())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(checkpoint / SHARDED_DIR))
    # strict=False: the frozen parameters are not in the checkpoint (they are the base model's, already loaded)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(strict=False))


def missing_sharded(checkpoint: Path) -> list[str]:
    """What a sharded resume needs from ``checkpoint`` and it lacks."""
    return [] if (checkpoint / SHARDED_DIR / ".metadata").is_file() else [f"{SHARDED_DIR}/.metadata"]


def gather_full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole TrainModule's state dict on the main process's CPU, every parameter in full (collective: every
    process calls it; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_copy(module: nn.Module, full_state: dict[str, torch.Tensor], cfg: TrainConfig) -> nn.Module:
    """A plain (unsharded, CPU) TrainModule holding ``full_state``, for finetune.checkpoint to export as it exports
    any run's: built on the meta device from the same recipe (LoRA, mask row, gate), so no second copy of the
    weights is made, then given the gathered tensors."""
    from transformers import AutoModelForCausalLM

    from finetune.train_model import TrainModule, prepare_model

    lm = module.causal_lm()
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(lm.config)
        copy = TrainModule(prepare_model(plain, cfg, None), cfg, module.mask_id)
    copy.load_state_dict(full_state, assign=True)
    copy.causal_lm().tie_weights()   # assign=True gave the embedding and a tied head two tensors: one again
    copy.causal_lm().generation_config = lm.generation_config
    return copy.eval()

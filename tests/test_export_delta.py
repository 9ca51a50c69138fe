"""finetune.recipes.export_delta: a full fine-tune's change as a low-rank mars-lora-v1 adapter that today's loader
merges."""

import json
import os
import re
import stat

import pytest
import torch

from finetune.recipes.export_delta import low_rank, main
from finetune.train import main as train_main
from tests.tiny_fixtures import train_flags


def test_low_rank_is_exact_at_full_rank_and_keeps_the_largest_directions():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(12, 5, generator=g) @ torch.randn(5, 9, generator=g)   # rank 5
    a, b, kept = low_rank(d, 5)
    assert a.shape == (5, 9) and b.shape == (12, 5) and kept == pytest.approx(1.0)
    torch.testing.assert_close(b @ a, d, atol=1e-4, rtol=1e-4)
    a2, b2, kept2 = low_rank(d, 2)
    s = torch.linalg.svdvals(d)
    assert kept2 == pytest.approx(float((s[:2] ** 2).sum() / (s ** 2).sum()), rel=1e-5)
    assert torch.linalg.matrix_norm(d - b2 @ a2) == pytest.approx(float(s[2:].norm()), rel=1e-4)
    a8, b8, _ = low_rank(d, 8)   # more rank than the matrix has: zero-padded to the config's r
    assert a8.shape == (8, 9) and b8.shape == (12, 8)


@pytest.fixture(scope="module")
def full_ft(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "run"
    train_main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "3", "--lr", "1e-2", "--train-mask-row",
                           "--freeze-embeddings", "--decay", "constant"))
    return out / "checkpoint-3"


def test_the_delta_at_full_rank_loads_through_the_adapter_path_and_decodes_like_the_fine_tune(tiny, full_ft,
                                                                                             tmp_path, monkeypatch):
    from mars_core import DecodeConfig, generate, load_model

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _ = tiny
    out = tmp_path / "delta"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "64", "--out", str(out),
                 "--dtype", "float32"]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["format"] == "mars-lora-v1" and cfg["r"] == cfg["alpha"] == 64
    merged = load_model(str(out), device="cpu", dtype="float32", cpu_layout=False)
    tuned = load_model(str(full_ft), device="cpu", dtype="float32", cpu_layout=False)
    ids = merged.tokenizer("12 + 7 =")["input_ids"]
    with torch.no_grad():
        a = merged.model(torch.tensor([ids])).logits
        b = tuned.model(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)   # norms, mask row and every matrix carried over
    prompt = "What is 12 + 7?"
    for cfg_ in (DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16),
                 DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16)):
        assert generate(merged, [prompt], cfg_)[0].token_ids == generate(tuned, [prompt], cfg_)[0].token_ids
    ar = generate(merged, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=16))[0]
    assert generate(merged, [prompt],
                    DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16))[0].token_ids == ar.token_ids


def test_a_fine_tune_that_moved_the_embedding_is_refused_by_name(tiny, tmp_path):
    model_dir, _ = tiny
    out = tmp_path / "run"
    train_main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "1", "--lr", "1e-2", "--decay", "constant"))
    with pytest.raises(ValueError, match="embedding rows besides the mask token's changed.*--freeze-embeddings"):
        main(["--checkpoint", str(out / "checkpoint-1"), "--base", str(model_dir), "--out", str(tmp_path / "d")])
    with pytest.raises(ValueError, match="--rank 0"):
        main(["--checkpoint", str(out / "checkpoint-1"), "--base", str(model_dir), "--rank", "0",
              "--out", str(tmp_path / "d")])


def test_int8_factors_are_within_one_rounding_step_and_a_zero_component_stays_zero():
    from mars_core.models.adapter import quantize_factors

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 20, generator=g), torch.randn(15, 6, generator=g)
    a[3], b[:, 3] = 0, 0   # a padded (zero) component
    q = quantize_factors(a, b)
    assert q["lora_A"].dtype == q["lora_B"].dtype == torch.int8
    assert q["lora_A_scale"].shape == q["lora_B_scale"].shape == (6,)
    back_a = q["lora_A"].float() * q["lora_A_scale"][:, None]
    back_b = q["lora_B"].float() * q["lora_B_scale"][None, :]
    assert ((back_a - a).abs() <= q["lora_A_scale"][:, None] / 2 + 1e-7).all()
    assert ((back_b - b).abs() <= q["lora_B_scale"][None, :] / 2 + 1e-7).all()
    assert not back_a[3].any() and not back_b[:, 3].any()
    assert q["lora_A"].abs().amax(dim=1)[[0, 1, 2, 4, 5]].eq(127).all()   # each row uses the whole int8 range


def test_an_int8_delta_is_half_the_bytes_loads_and_decodes_like_the_float_one(tiny, full_ft, tmp_path, monkeypatch):
    """--dtype int8 stores the factors as int8 with a scale per rank component; the loader dequantizes them, so
    the merged model is the float32 delta's up to int8 rounding, τ = 1 is its AR and lossless equals AR."""
    from mars_core import DecodeConfig, generate, load_model
    from mars_core.models.adapter import read_adapter

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _ = tiny
    outs = {}
    for dtype in ("float32", "bfloat16", "int8"):
        outs[dtype] = tmp_path / dtype
        assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "16", "--out",
                     str(outs[dtype]), "--dtype", dtype]) == 0
    from safetensors.torch import load_file

    def factor_bytes(folder):
        return sum(t.numel() * t.element_size() for k, t in load_file(str(folder / "adapter.safetensors")).items()
                   if ".lora_" in k)
    size = {d: factor_bytes(o) for d, o in outs.items()}
    assert size["int8"] < 0.55 * size["bfloat16"] < 0.3 * size["float32"]
    cfg, mods8, _ = read_adapter(outs["int8"])
    _, mods32, _ = read_adapter(outs["float32"])
    assert cfg["dtype"] == "int8" and set(mods8) == set(mods32)
    for m, (a, b) in mods32.items():
        assert mods8[m][0].dtype == torch.float32
        err = (mods8[m][1] @ mods8[m][0] - b @ a).norm() / (b @ a).norm().clamp_min(1e-12)
        assert err < 0.03, m
    merged = load_model(str(outs["int8"]), device="cpu", dtype="float32", cpu_layout=False)
    prompt = "What is 12 + 7?"
    ar = generate(merged, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=16))[0]
    assert generate(merged, [prompt], DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16))[0].token_ids == \
        ar.token_ids
    assert generate(merged, [prompt], DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16))[0].token_ids == \
        ar.token_ids


def test_an_int8_adapter_without_its_scales_is_refused_by_name(tiny, full_ft, tmp_path):
    from safetensors.torch import load_file, save_file

    from mars_core.models.adapter import read_adapter

    model_dir, _ = tiny
    out = tmp_path / "d"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "4", "--out", str(out),
                 "--dtype", "int8"]) == 0
    tensors = load_file(str(out / "adapter.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B_scale"))
    tensors.pop(key)
    save_file(tensors, str(out / "adapter.safetensors"))
    with pytest.raises(ValueError, match=key.rpartition(".")[0].replace(".", r"\.") + " has only"):
        read_adapter(out)


def modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_exported_delta_and_a_checkpoint_get_the_users_umask_not_private_modes(tiny, full_ft, tmp_path, umask):
    """safetensors writes its files 0600 and a temp folder is made 0700; a folder another user on the machine is
    meant to load must come out as a plain mkdir/open would make it under the umask, and never wider."""
    model_dir, _ = tiny
    old = os.umask(umask)
    try:
        assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "4", "--out",
                     str(tmp_path / "delta"), "--dtype", "int8"]) == 0
        ckpt = tmp_path / "run"
        train_main(train_flags(tiny, ckpt, "--stage", "mars", "--max-steps", "1", "--decay", "constant"))
    finally:
        os.umask(old)
    for folder in (tmp_path / "delta", ckpt, ckpt / "checkpoint-1"):
        got = modes(folder)
        assert "adapter.safetensors" in got or "model.safetensors" in got or folder == ckpt, got
        want = {name: (0o777 if (folder / name).is_dir() or name == folder.name else 0o666) & ~umask
                for name in got}
        assert got == want, folder


def test_allocate_ranks_takes_the_most_energy_per_byte_and_stays_within_the_budget():
    from finetune.recipes.export_delta import allocate_ranks

    spectra = {"big": torch.tensor([10.0, 6.0, 1.0]), "small": torch.tensor([3.0, 2.0, 0.5]),
               "zero": torch.zeros(3)}
    costs = {"big": 20, "small": 10, "zero": 10}
    # values per byte (absolute): big 5.0, 1.8, 0.05; small 0.9, 0.4, 0.025 -> big, big, small, small
    assert allocate_ranks(spectra, costs, 60) == {"big": 2, "small": 2}
    assert allocate_ranks(spectra, costs, 59) == {"big": 2, "small": 1}
    assert allocate_ranks(spectra, costs, 19) == {}   # not even the first component fits
    # relative: each matrix's share per byte: big 100/137/20 = 0.036..., small 9/13.25/10 = 0.068 -> small first
    assert allocate_ranks(spectra, costs, 10, "relative") == {"small": 1}
    assert allocate_ranks(spectra, costs, 10, "absolute") == {}
    big = allocate_ranks(spectra, costs, 1000)
    assert big == {"big": 3, "small": 3}   # everything that carries energy; the zero matrix never
    with pytest.raises(ValueError, match="allocate='best'"):
        allocate_ranks(spectra, costs, 60, "best")


@pytest.mark.parametrize("allocate", ["absolute", "relative"])
def test_a_delta_with_a_rank_per_matrix_fits_its_size_and_loads_through_the_adapter_path(tiny, full_ft, tmp_path,
                                                                                       monkeypatch, allocate):
    """--max-mb: the weights file stays within the size, the config names each matrix's rank, the loader merges it
    (equal to merging the same factors by hand), and τ = 1 and lossless decode as its AR."""
    from safetensors.torch import load_file

    from mars_core import DecodeConfig, generate, load_model
    from mars_core.models.adapter import read_adapter

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _dtype = tiny
    uniform = tmp_path / "uniform"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "4", "--out", str(uniform),
                 "--dtype", "int8"]) == 0
    budget = (uniform / "adapter.safetensors").stat().st_size / 1e6   # the rank-4 file's size, spent per matrix
    out = tmp_path / allocate
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--max-mb", f"{budget}", "--allocate",
                 allocate, "--out", str(out), "--dtype", "int8"]) == 0
    assert (out / "adapter.safetensors").stat().st_size <= budget * 1e6
    cfg, modules, _row = read_adapter(out)
    ranks = cfg["ranks"]
    assert cfg["r"] == cfg["alpha"] == max(ranks.values()) and cfg["allocate"] == allocate
    assert set(ranks) == set(modules) and len(set(ranks.values())) > 1   # the ranks differ between matrices
    for m, (a, b) in modules.items():
        assert a.shape[0] == b.shape[1] == ranks[m]
    tensors = load_file(str(out / "adapter.safetensors"))
    assert all(tensors[f"{m}.lora_A_scale"].shape == (ranks[m],) for m in ranks)
    merged = load_model(str(out), device="cpu", dtype="float32", cpu_layout=False)
    base = load_model(str(model_dir), device="cpu", dtype="float32", cpu_layout=False)
    named = dict(merged.model.named_modules())
    for m, (a, b) in modules.items():   # W_base + B @ A, scale alpha / r = 1
        torch.testing.assert_close(named[m].weight, base.model.get_submodule(m).weight + b @ a, atol=1e-5, rtol=0)
    prompt = "What is 12 + 7?"
    ar = generate(merged, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=16))[0]
    for cfg_ in (DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16),
                 DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16)):
        assert generate(merged, [prompt], cfg_)[0].token_ids == ar.token_ids


def test_a_rank_per_matrix_that_does_not_match_the_file_is_refused_by_name(tiny, full_ft, tmp_path):
    from mars_core.models.adapter import read_adapter

    model_dir, _ = tiny
    out = tmp_path / "d"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--max-mb", "0.2", "--out", str(out),
                 "--dtype", "int8"]) == 0
    path = out / "adapter_config.json"
    cfg = json.loads(path.read_text())
    module = sorted(cfg["ranks"])[0]

    def refused(change, match):
        bad = dict(cfg, ranks=dict(cfg["ranks"]))
        change(bad["ranks"])
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            read_adapter(out)

    def one_less(ranks):
        ranks[module] = ranks[module] - 1 if ranks[module] > 1 else 2
    refused(one_less, re.escape(module) + r" lora_A .* do not have the config's rank ranks\[\.\.\.\]=")
    refused(lambda ranks: ranks.pop(module), r"ranks and the file's modules differ .*only in the file: \['"
            + re.escape(module))
    refused(lambda ranks: ranks.update({"model.layers.9.mlp.up_proj": 1}), "only in the config")
    refused(lambda ranks: ranks.update({module: cfg["r"] + 1}), "ranks=.* must map each adapted module path to its "
            "rank, 1 to r=")
    with pytest.raises(ValueError, match="--max-mb 0.0001: the mask row, norms and header alone take"):
        main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--max-mb", "0.0001", "--out",
              str(tmp_path / "e"), "--dtype", "int8"])
    with pytest.raises(ValueError, match="--max-mb -1"):
        main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--max-mb", "-1", "--out",
              str(tmp_path / "e")])


def test_a_cut_in_output_space_moves_the_calibration_outputs_less_than_the_plain_cut():
    """With inputs of very different scales per feature, the whitened rank-r cut of D has a smaller output error
    ‖(D − B A) X‖ on those inputs than the plain SVD's (which is best in weight space only); at full rank both are D."""
    from finetune.recipes.export_delta import _factors, _svd, whitener

    g = torch.Generator().manual_seed(3)
    d = torch.randn(20, 12, generator=g, dtype=torch.float64).float()
    x = (torch.randn(400, 12, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, 12, dtype=torch.float64))
    moment = x.T @ x / x.shape[0]
    low = whitener(moment)
    torch.testing.assert_close(low @ low.T, moment, rtol=1e-5, atol=2e-6 * float(moment.diagonal().mean()))  # ridge
    out_err = {}
    for name, m in (("plain", None), ("white", low)):
        a, b, _ = _factors(_svd(d, m), 4, pad=False)
        out_err[name] = float(((d.double() - (b @ a).double()) @ x.T).norm())
        full_a, full_b, kept = _factors(_svd(d, m), 12, pad=False)
        torch.testing.assert_close(full_b @ full_a, d, rtol=1e-4, atol=1e-4)
        assert kept == pytest.approx(1.0)
    assert out_err["white"] < 0.8 * out_err["plain"], out_err


def test_a_calibrated_delta_records_its_inputs_and_decodes_like_its_ar(tiny, full_ft, tmp_path, monkeypatch):
    from mars_core import DecodeConfig, generate, load_model

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, data = tiny
    out = tmp_path / "white"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--max-mb", "0.2", "--calibration",
                 str(data), "--n-calibration", "8", "--out", str(out), "--dtype", "int8"]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["calibration"] == f"{data.name}, first 8 conversations (output energy)" and cfg["ranks"]
    assert (out / "adapter.safetensors").stat().st_size <= 0.2e6
    lm = load_model(str(out), device="cpu", dtype="float32", cpu_layout=False)
    prompt = "What is 12 + 7?"
    ar = generate(lm, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=16))[0]
    assert generate(lm, [prompt], DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16))[0].token_ids == ar.token_ids
    with pytest.raises(ValueError, match="--calibration 'nope.jsonl' is not a file"):
        main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--calibration", "nope.jsonl", "--out",
              str(tmp_path / "x")])
    bad = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    bad.write_text(good + "\nnot json\n")   # read as training data is (finetune.data): the line is named
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--calibration", str(bad), "--out",
              str(tmp_path / "x")])


def test_input_moments_equal_each_matrixs_own_inputs_second_moment(tiny):
    """Projections that share an input (q/k/v, gate/up) share one product; every module's moment is still E[x xᵀ] of
    exactly the inputs that module saw."""
    from finetune.data import read_chat_jsonl
    from finetune.recipes.export_delta import input_moments, linear_weights_modules
    from finetune.train_model import load_base

    model_dir, data = tiny
    base = load_base(str(model_dir))
    model, tok = base.model.float().eval(), base.tokenizer
    chats = read_chat_jsonl(data)[:3]
    got = input_moments(model, tok, chats)
    seen: dict[str, list] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, n=n: seen.setdefault(n, []).append(
        args[0].reshape(-1, args[0].shape[-1]).double().clone())) for n, m in linear_weights_modules(model).items()]
    with torch.no_grad():
        for messages in chats:
            ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"][:256]
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    assert set(got) == set(seen) and len(got) > 3
    for name, xs in seen.items():
        x = torch.cat(xs)
        torch.testing.assert_close(got[name], x.T @ x / x.shape[0], rtol=1e-9, atol=1e-12)

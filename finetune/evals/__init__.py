"""Evaluation suites and their data: what finetune/ measures a trained model with (imports the library only)."""

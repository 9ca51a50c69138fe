"""Experiment drivers: recipes, A/B runs, distillation, exports and model cards (import the library and evals)."""

"""Models: loading (load_model, wrap_model), sources (names, folders, hub ids, caches), formats, tokens and chat
templates, adapters, the catalogue, storage that never half-writes, export. Imports engine and decode."""

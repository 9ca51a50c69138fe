"""The MARS algorithm: decoding (generate_stream, the uncached reference), drafts and trees, batch rows,
DecodeConfig/TauControl and the step events. Imports nothing else of mars_core; custom_generate/mars_step.py is
vendored from exactly these modules (python -m mars_core.tools.vendor_custom_generate)."""

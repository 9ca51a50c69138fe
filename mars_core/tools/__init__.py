"""Tools over the library: the CLI (python -m mars_core), bench, other runtimes for comparison (llama.cpp,
ONNX Runtime GenAI), the timing harness, the fastest lossless layout, exit codes, the custom_generate vendoring."""

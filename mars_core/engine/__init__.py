"""The CPU inference engine: the lean forward (fp32, int8, w8a8, w8a16), its native C++ kernels (VNNI/AMX, AVX2,
the fp32 layer stack) compiled on first use, thread and memory layout, and the CPU's dtype probe. Imports only
mars_core.decode."""

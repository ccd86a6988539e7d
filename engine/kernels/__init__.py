"""Native kernels: matrix products on GGUF-quantized weights (gguf_kernels.cpp, built by extension.py)."""

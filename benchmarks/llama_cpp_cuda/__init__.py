"""llama.cpp's CUDA tools as the GPU benchmarks' peer, staged and built from this repository:
`python -m benchmarks.llama_cpp_cuda {stage,build,wait,convert,quantize,bench}` (see __main__)."""

__all__: list[str] = []

"""Measuring a step: the fake-tensor tracer, CUDA semantics on the CPU, the allocator simulation, the run."""

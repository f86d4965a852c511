"""Benchmarks: training throughput of zoo's models against the reference implementations of the same size.

``gpt.py`` zoo's GPT vs transformers' GPT2LMHeadModel / LlamaForCausalLM (``launch/benchmark.py``), ``unet.py`` zoo's
diffusion U-Net vs diffusers' UNet2DModel (``launch/benchmark_unet.py``).
"""

"""Benchmarks: training throughput of zoo's models against the reference implementations of the same size.

``gpt.py`` zoo's GPT vs transformers' GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM (``launch/benchmark.py``),
its parts by job: ``compare.py`` (the two models of a style and their trainees), ``measure.py`` (one style's run,
and zoo alone at tp > 1), ``roofline.py`` (the step's GEMMs at this device's rates), ``memory.py`` (a step's peak
memory), ``report.py`` (results, table, summary lines), ``gpu_suite.py`` (every GPU run in one command).
``unet.py`` zoo's diffusion U-Net vs diffusers' UNet2DModel (``launch/benchmark_unet.py``), ``long_context.py``
activation memory under context parallelism (``launch/benchmark_long_context.py``); ``common.py`` what they share.
"""

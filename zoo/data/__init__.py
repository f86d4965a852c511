"""Datasets: synthetic tokens now; corpus, tokenizers and Megatron-style indexed datasets next."""

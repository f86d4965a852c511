"""Checkpoint converters: the layout-free zoo model folder (io.py) and HuggingFace adapters."""

"""Datasets, each sample a pure function of its index (any rank reads any sample, every layout sees the same batch).

Text: the embedded corpus (``corpus``), byte-level BPE tokenizers (``tokenizer``), Megatron's indexed dataset
(``indexed``, written by ``preprocess``), GPT packing and blending (``gpt_dataset``), BERT sentence pairs, masking
and classification (``bert_dataset``, ``masking``), instruction data (``instruct``), synthetic tokens
(``synthetic``). Images: image/mask folders (``image_folders``) and procedural shapes (``shapes``). Shared: the
micro-batch order (``batches``) and the build-once cache (``cache``).
"""

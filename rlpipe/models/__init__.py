"""Models: the built-in char tokenizer, the tiny default model, HF loading, packed forward, GGUF import.

Import the submodules directly (``from rlpipe.models.tokenizer import build_tiny_tokenizer``); this package
file stays import-light so that importing one helper does not pull in every dependency.
"""

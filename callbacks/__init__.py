"""Trainer callbacks of hf-paged, installed as ``hf_paged.callbacks``."""

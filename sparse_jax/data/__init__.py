"""Data: tokenizers (and, later, text corpora and synthetic tasks)."""

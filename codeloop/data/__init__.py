"""Datasets and what tiny runs need: a tokenizer trained locally (`tokenizer.py`)."""

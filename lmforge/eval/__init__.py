"""Evaluation: language-model loss, perplexity and bits per byte."""

"""Notebook-first, executable reproduction of compliant LLM pretraining (Apertus, Soofi S)."""

__version__ = "0.1.0"

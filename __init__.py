"""foldline: an ahead-of-time compiler and embedded runtime for hybrid language models."""

__version__ = "0.1.0"

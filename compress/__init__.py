"""llm-compress: offline compression toolkit for large language models."""

__version__ = "0.1.0"

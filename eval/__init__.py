"""Evaluation: perplexity and KL divergence against a reference, the reference model, reports."""

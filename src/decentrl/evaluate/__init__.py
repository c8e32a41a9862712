"""Evaluation: accuracy and pass@k on held-out problems, with confidence intervals."""

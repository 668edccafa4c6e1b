"""The OpenAI-compatible server (phase 2): ``python -m infer.server``."""

"""The engine: scheduler (what runs), model runner (how), output processor (what it means)."""

from infer.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]

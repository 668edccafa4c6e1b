"""Attention: the metadata object, KV caches and backends (see docs/phases/)."""

from infer.attention.kv_cache import KVCache
from infer.attention.metadata import AttentionMetadata
from infer.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "KVCache", "TorchAttentionBackend"]

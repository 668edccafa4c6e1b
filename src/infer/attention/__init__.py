"""Attention: the metadata object, KV caches and backends (see docs/phases/)."""

from infer.attention.kv_cache import KVCache
from infer.attention.metadata import AttentionMetadata
from infer.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "KVCache", "TorchAttentionBackend", "make_attention_backend"]


def make_attention_backend(name: str, device):
    """The attention backend called ``name``, chosen once per engine: ``"torch"``
    (:class:`TorchAttentionBackend`, plain PyTorch) or ``"triton"``
    (:class:`~infer.attention.triton_backend.TritonAttentionBackend`, the Triton kernels).

    Raises:
        ValueError: another name.
    """
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from infer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}")

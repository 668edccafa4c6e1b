"""Exceptions raised by infer."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(Exception):
    """A model could not be loaded. The message names the file (or model) and what is wrong.

    Attributes:
        path: the file or directory (or short name) concerned.
        reason: what is wrong with it.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")

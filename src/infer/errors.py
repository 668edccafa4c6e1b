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


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given (the server answers HTTP 400).

    Attributes:
        param: the offending field (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)

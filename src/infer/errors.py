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

    def __reduce__(self):  # pickled with what __init__ takes (an engine process sends it to the server's)
        return type(self), (self.path, self.reason)


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given (the server answers HTTP 400).

    Attributes:
        param: the offending field (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)

    def __reduce__(self):  # keeps ``param`` through pickle (an engine process sends it to the server's)
        return type(self), (str(self), self.param)


class EngineStepError(RuntimeError):
    """A step of the engine failed (a bug, a device error): raised by ``LLMEngine.step``.

    The engine has already aborted every request that was in the failed step and freed its
    KV-cache blocks, so it stays usable: the requests that were not in the step carry on at
    the next step. The original exception is ``__cause__``.

    Attributes:
        request_ids: the requests that were in the step (now aborted, ``finish_reason="error"``).
        outputs: their final outputs (``RequestOutput``, ``finish_reason="error"``, with their
            timings), for whoever counts finished requests (the server's metrics).
    """

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: list | None = None) -> None:
        self.request_ids = request_ids
        self.outputs = outputs or []
        super().__init__(f"an engine step failed with {type(cause).__name__}: {cause}; "
                         f"its {len(request_ids)} request(s) were aborted")


class ParallelWorkerError(RuntimeError):
    """A rank of a tensor/expert-parallel engine died or left the ranks out of step (phase 14).

    Raised by ``LLMEngine.step`` after the step's requests were aborted (``finish_reason="error"``).
    Unlike :class:`EngineStepError` the engine cannot go on: the other ranks' collectives have no
    partner any more, so every worker has been stopped and each later step raises this again.
    """

"""Tensor and expert parallelism over ``torch.distributed`` (phases 14-15).

:mod:`~infer.parallel.state` records which rank this process is (the layers read it while the
model is built, so each rank builds only its shard); :mod:`~infer.engine.executor` starts one
worker process per extra rank and runs each step on all of them.
"""

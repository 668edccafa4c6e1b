"""Classroom tooling for infer: exercises cut from the engine's own code, graded by its tests.

Not part of the ``infer`` package (``import infer`` loads none of it). Run from the repository's root:
``python -m classroom list`` (see :mod:`classroom.exercises`).
"""

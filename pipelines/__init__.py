"""Task -> StageGraph builders per model family, the model registry and the Python API."""

from pipelines.api import Pipeline

__all__ = ["Pipeline"]

"""Triton Python-backend entry for the `target` model; the logic lives in dflow_trt.serving."""

from dflow_trt.serving.triton_python import TargetModel as TritonPythonModel  # noqa: F401

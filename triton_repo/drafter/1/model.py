"""Triton Python-backend entry for the `drafter` model; the logic lives in dflow_trt.serving."""

from dflow_trt.serving.triton_python import DrafterModel as TritonPythonModel  # noqa: F401

"""Triton Python-backend entry for the `dflow` model; the logic lives in dflow_trt.serving."""

from dflow_trt.serving.triton_python import DFlowModel as TritonPythonModel  # noqa: F401

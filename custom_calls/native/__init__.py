"""The native launcher, shared by both kernel families (DeepGEMM's CUDA kernels and Triton kernels
compiled to cubins): one XLA custom call that runs a launch plan, or a few in order.

* launch_plan.py: `LaunchPlan` / `TensorMap` / `KernelArg`, a kernel launch as plain data, and
  their encoding as the custom call's static attributes;
* launch.py: the C++ FFI handler (csrc/launch_handler.cc) built, registered with XLA and called;
* toolchain.py: nvcc and the kernel sources found, the on-disk cache of cubins and the handler
  (`cached_artifact`), the device detected.

Importing this package imports no CUDA Python binding and probes no device.
"""

from custom_calls.native.launch_plan import KernelArg, LaunchPlan, TensorMap

__all__ = ["KernelArg", "LaunchPlan", "TensorMap"]

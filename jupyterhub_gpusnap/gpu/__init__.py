"""The GPU layer: everything that talks to the NVIDIA driver, and nothing else.

- :mod:`.nvml`: NVML opened once per process (devices, memory, per-process use).
- :mod:`.cuda`: the CUDA driver's checkpoint API (lock, checkpoint, restore, unlock a process).
- :mod:`.park`: parking, a kernel's GPU memory moved to host RAM while the process runs on.
- :mod:`.view`: the GPUs of a machine and who holds what on them (the make-room view).
- :mod:`.compat`: whether a checkpoint's GPUs fit a machine's GPUs.
- :mod:`.autounpark`: in the single-user server, a parked kernel's GPU memory brought back
  when it runs a cell.

This is a bottom floor: it imports only the standard library, third-party packages and the
modules below it that import nothing of the project (``errors``, ``model``, ``procs``), never
the checkpoint backends, signals, watcher, spawners, handlers or the agent; they import it.
``tests/test_gpu_layer.py`` checks this.
"""

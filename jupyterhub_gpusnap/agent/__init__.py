"""The node agent (``jupyterhub-gpusnap-agent``): a privileged, hostPID DaemonSet on GPU nodes.

It reads per-pod CPU (cgroup v2) and GPU (NVML) activity, checkpoints containers
through the kubelet and ships the archives off the node as OCI images (or to a PVC),
and restores them. The service and the spawner talk to it over a small JSON API
(see :mod:`jupyterhub_gpusnap.agent.app`).
"""

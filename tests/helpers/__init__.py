"""The tests' helpers: real servers and fakes the tests (and the benches) start.

Import them by their package path, ``from tests.helpers.realhub import RealHub``; pytest puts
the repository root on ``sys.path`` (``pythonpath`` in pyproject.toml) and a bench script
does so through ``bench/common.py``.

- ``realhub``: a real JupyterHub and configurable-http-proxy in a temporary folder
- ``gpusnap_service``: the gpusnap service as a Hub-managed process of such a hub
- ``smtp_server``: a real SMTP server (aiosmtpd) that keeps what it receives
- ``kernel_ws``: start a kernel and run code in it over the Jupyter websocket
- ``fake_kube``: a wire-level Kubernetes API server and kubelet, with a fake agent
- ``oci_runtime``: real runc containers in pod sandboxes, as a node's runtime runs them
- ``registry``: a real OCI registry (token and basic auth)
- ``fault_proxy``: an HTTP gateway that fails the requests a test names
- ``fake_prometheus``: a Prometheus query API with the series a test gives it
- ``gpu_helpers``: processes that hold GPU memory (also a script: ``python tests/helpers/gpu_helpers.py``)
- ``ports``: free TCP ports, never the same twice in one run
"""

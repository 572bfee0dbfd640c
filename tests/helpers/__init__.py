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

Shared pieces of the tests themselves (a test module imports these, never another test module):

- ``fake_gpu``: driver-level fakes of ``libcuda.so.1``'s checkpoint API and of NVML
- ``process_tree``: real process trees for CRIU (``ProcessTree``, ``TREE_PROGRAM``, ``SHARED_TREE``)
- ``shared_chunks``: two users' servers suspended to chunks they share
- ``local_hub``: a Hub whose servers the local backend suspends and restores, as the service does
- ``access_hub``: a hub with servers, gpusnap's reader and admin roles, and the service
- ``extension_env``: the server and Lab extensions installed for a single-user server
- ``browser_tab``: a kernel websocket kept open through the proxy, a cell sent into it
- ``kernel_manager``: a kernel of a jupyter_server kernel manager: wait for a state, start a cell
- ``jupyter_server``: a plain jupyter server with the auto-unpark extension
- ``gpu_notebook``: a cell that fills GPU memory, and what GPU 0 holds
- ``policy_samples``: a server's status and a quiet sample for the policy's tests
- ``metrics``: read a sample of the service's Prometheus metrics
"""

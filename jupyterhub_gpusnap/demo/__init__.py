"""The demo: a real JupyterHub with the gpusnap service, the local CRIU backend and an SMTP sink."""

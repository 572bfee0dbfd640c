"""jupyterhub-gpusnap: suspend idle notebook servers (CPU + GPU memory) instead of killing them."""

__version__ = "0.1.0"

# JupyterHub config of the jupyterhub-gpusnap demo (written by `python -m jupyterhub_gpusnap.demo`).
# Every line here is what an admin of a single GPU machine would write; see docs/install.md.

c = get_config()  # noqa

c.JupyterHub.bind_url = "http://127.0.0.1:@PORT@"
c.JupyterHub.db_url = "sqlite:///@ROOT@/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "@ROOT@/jupyterhub_cookie_secret"
c.ConfigurableHTTPProxy.pid_file = "@ROOT@/jupyterhub-proxy.pid"

# What a Hub shutdown (Ctrl-C) does to running servers: the demo stops them (JupyterHub's default),
# so nothing keeps running once the demo is gone; suspended servers keep their checkpoints. A real
# hub sets it to False, so that restarting the Hub leaves everyone's kernels alone (docs/install.md).
c.JupyterHub.cleanup_servers = True

# Keep the terminal readable: the gpusnap service lists the servers every 10 s and the Lab panel
# polls too; their successful GETs of the Hub API are logged at DEBUG instead of INFO.
from jupyterhub.log import access_log, log_request  # noqa: E402


def log_request_quietly(handler):
    if (
        handler.request.method == "GET"
        and handler.get_status() < 300
        and handler.request.path.startswith("/hub/api/")
    ):
        access_log.debug("%d GET %s", handler.get_status(), handler.request.path)
        return
    log_request(handler)


c.JupyterHub.tornado_settings = {"log_function": log_request_quietly}

# Demo login: any user name, password "demo". Use your real authenticator in production.
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = "demo"
c.Authenticator.allow_all = True

# Restore-on-spawn spawner. The demo runs every user as root in @ROOT@/home/<user>;
# on a real machine use SnapLocalProcessSpawner (system users).
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapSimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = "@ROOT@/home/{username}"
c.Spawner.args = ["--allow-root"]
c.Spawner.default_url = "/lab"
c.Spawner.environment = {"GPUSNAP_SERVICE_URL": "http://127.0.0.1:@PORT@/services/gpusnap/"}
c.LocalBackend.checkpoint_dir = "@ROOT@/checkpoints"

# The user's return restores the server by itself, with the "suspended … restoring" page.
from jupyterhub_gpusnap.hubconfig import (  # noqa: E402
    CUSTOM_SCOPES,
    TEMPLATE_PATH,
    server_token_scopes,
    service_role,
    user_role,
)

c.JupyterHub.template_paths = [TEMPLATE_PATH]
c.JupyterHub.implicit_spawn_seconds = 3
c.JupyterHub.custom_scopes = CUSTOM_SCOPES

c.JupyterHub.services = [
    {
        "name": "gpusnap",
        "url": "http://127.0.0.1:10101",
        "command": [
            "@PYTHON@",
            "-m",
            "jupyterhub_gpusnap.app",
            "--config",
            "@ROOT@/gpusnap_config.py",
        ],
        "cwd": "@ROOT@",
        "oauth_no_confirm": True,
        "oauth_client_allowed_scopes": ["custom:gpusnap:read", "custom:gpusnap:admin"],
        "display": True,
        "info": {
            "description": "Where your notebook server stands: active, idle, suspended, restored."
        },
    }
]
# "admin" (password "demo") is the demo's Hub admin and sees every server on /services/gpusnap/admin.
c.Authenticator.admin_users = {"admin"}
# each server's extension reports its kernels to the service with the server's own token: the
# token (and so its user) must reach the service; the service itself gets no access to servers
c.Spawner.server_token_scopes = server_token_scopes("gpusnap")
c.JupyterHub.load_roles = [
    service_role("gpusnap", email_from_auth_state=False),
    user_role("gpusnap"),
    {"name": "gpusnap-admins", "scopes": ["custom:gpusnap:admin"], "users": ["admin"]},
]

with open("@ROOT@/gpusnap_config.py", "w") as f:
    f.write(
        """
c = get_config()  # noqa
c.GpuSnap.interval = 10
c.GpuSnap.idle_window = @IDLE@
c.GpuSnap.warn_before = @IDLE@ // 2
c.GpuSnap.min_running = 30
c.GpuSnap.db_url = "sqlite:///@ROOT@/gpusnap.sqlite"
c.GpuSnap.proxy_url = "http://127.0.0.1:@PORT@"
c.LocalBackend.checkpoint_dir = "@ROOT@/checkpoints"
c.GpuSnap.email = True
c.Mailer.smtp_host = "127.0.0.1"
c.Mailer.smtp_port = @SMTP_PORT@
c.Mailer.smtp_security = "none"
c.Mailer.from_address = "gpusnap@localhost"
c.Notifier.address_from = "template"
c.Notifier.address_template = "{username}@localhost"
c.Notifier.send_restored = True
"""
    )

"""What the node agent asks of the Kubernetes API, as RBAC rules.

One list, used twice: the agent's ``GET /v1/doctor`` checks each rule with a
SelfSubjectAccessReview, and the agent's ClusterRole in ``helm-values/agent/rbac.yaml``
grants exactly these rules for the Helm configuration (a test compares the two), so the
agent holds no permission it does not use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Need:
    """One RBAC rule the agent uses: ``verb`` on ``group``/``resource``[/``subresource``]."""

    verb: str
    group: str
    resource: str
    subresource: str
    why: str

    @property
    def name(self) -> str:
        """``create nodes/checkpoint`` style, as doctor prints it."""
        sub = f"/{self.subresource}" if self.subresource else ""
        return f"{self.verb} {self.resource}{sub}"

    def review(self) -> dict:
        """The ``resourceAttributes`` of a SelfSubjectAccessReview for this rule (cluster-wide)."""
        attrs = {"verb": self.verb, "resource": self.resource}
        if self.group:
            attrs["group"] = self.group
        if self.subresource:
            attrs["subresource"] = self.subresource
        return attrs


def agent_rbac_needs(auth: str, kubelet_route: str, kubelet_address_known: bool) -> list[Need]:
    """The cluster-wide rules the agent uses with this configuration.

    ``auth`` is ``AgentApp.auth``, ``kubelet_route`` ``KubeletClient.kubelet_route``, and
    ``kubelet_address_known`` whether ``KubeletClient.kubelet_host`` and ``kubelet_port``
    are both set (otherwise the agent reads its Node object for the kubelet's address).
    """
    needs = [
        Need("get", "", "pods", "", "read the pod to checkpoint or restore into (UID, node)"),
        Need("list", "", "pods", "", "list the pods of this node (signals, host PIDs to pods)"),
    ]
    if kubelet_route == "direct":
        needs.append(
            Need("create", "", "nodes", "checkpoint", "the kubelet's POST /checkpoint/...")
        )
        if not kubelet_address_known:
            needs.append(
                Need(
                    "get",
                    "",
                    "nodes",
                    "",
                    "find the kubelet's address (set KubeletClient.kubelet_host and "
                    "kubelet_port to drop this)",
                )
            )
    else:
        needs.append(
            Need("create", "", "nodes", "proxy", "the kubelet checkpoint through the API server")
        )
    if auth == "tokenreview":
        needs.append(
            Need(
                "create",
                "authentication.k8s.io",
                "tokenreviews",
                "",
                "check the callers' ServiceAccount tokens",
            )
        )
    return needs

#!/usr/bin/env bash
# The container runtime the Kubernetes tests run real pods with (tests/helpers/oci_runtime.py):
# Debian's runc (1.1.5; checkpoints through our CRIU 4.2.1, .ci/install-criu.sh) and
# mmdebstrap, then the notebook image's root filesystem (Debian bookworm with python3,
# jupyter-server and ipykernel), built once and cached under /var/cache/gpusnap-test
# (GPUSNAP_RUNTIME_CACHE), keyed by its inputs: a second run only checks.
# Debian's crun is built without CRIU and podman's defaults fail on hosts with cgroup v1
# controllers, so the tests drive runc directly, as CRI-O does.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
missing=()
for p in runc mmdebstrap iproute2 util-linux; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
start=$(date +%s)
rootfs=$(python3 -c 'from tests.helpers import oci_runtime; print(oci_runtime.image_rootfs())')
echo "container runtime: $(runc --version | head -1), image root filesystem $rootfs ($(( $(date +%s) - start )) s)"

#!/usr/bin/env bash
# Build and install CRIU 4.2.1 from Debian's source tarball into /usr/local/sbin/criu.
# Debian bookworm's packaged criu (3.17) fails `criu check` on kernels >= 6.13 and
# 4.1 cannot dump TCP sockets there; 4.2 works. Idempotent: does nothing when a
# criu >= 4.2 is already on PATH.
set -euo pipefail
WANT=4.2.1
SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PREFIX=${CRIU_PREFIX:-/usr/local}

have=$(criu --version 2>/dev/null | awk '/^Version:/{print $2}' || true)
if [ -n "$have" ] && [ "$(printf '%s\n4.2\n' "$have" | sort -V | head -1)" = "4.2" ]; then
  echo "criu $have already installed"; exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends build-essential pkg-config curl xz-utils \
  libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libprotobuf-dev \
  libnl-3-dev libnet1-dev libcap-dev uuid-dev libbsd-dev libnftables-dev \
  python3-protobuf nftables iproute2 >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL -o "$work/criu.tar.xz" "$MIRROR/pool/main/c/criu/criu_${WANT}.orig.tar.xz"
echo "$SHA256  $work/criu.tar.xz" | sha256sum -c - >/dev/null
tar -C "$work" -xJf "$work/criu.tar.xz"
src=$(find "$work" -maxdepth 1 -type d -name 'criu-*' | head -1)
make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
install -D -m 0755 "$src/criu/criu" "$PREFIX/sbin/criu"
mkdir -p /etc/criu
grep -qs '^network-lock' /etc/criu/default.conf || echo 'network-lock nftables' >>/etc/criu/default.conf
echo "installed $("$PREFIX/sbin/criu" --version | head -1) to $PREFIX/sbin/criu"

#!/usr/bin/env bash
# Build and install CRIU 4.2.1 from Debian's source tarball into /usr/local/sbin/criu,
# with the patches in .ci/criu-patches: `criu dump` reads another user's resource limits
# from /proc/<pid>/limits when prlimit needs the CAP_SYS_RESOURCE that root in a container
# lacks (without it a server running as a Unix user cannot be checkpointed there), and
# `criu lazy-pages` asks for more than one page per fault, for larger background
# transfers, keeps several of them in flight (a lazy restore's sequential readers and
# GPU processes' thousands of page runs), lets the page server answer a page fault
# before the background requests asked earlier, and asks for the pages around a fault
# with it, and merges the dump's 1 MiB runs of pages into ranges (larger requests, at most
# 8 MiB of them in flight), lets go of memory a process unmaps before it came (upstream
# could ask for it again for ever) and follows memory it moves (upstream could leave it
# zero-filled), copies again what a changing memory map refused instead of asking again,
# and copies the background transfer into the processes on copier threads while it
# receives the next pages, maps pages known to hold zeros as zero pages instead of
# asking for them, and keeps 32 small background requests in flight; and `criu dump` no longer makes a whole process eager when a
# thread's stack pointer is on a page boundary (docs/lazy-restore.md).
# Debian bookworm's packaged criu (3.17) fails `criu check` on kernels >= 6.13 and
# 4.1 cannot dump TCP sockets there; 4.2 works. Idempotent: does nothing when a
# criu >= 4.2 with the patches is already on PATH.
set -euo pipefail
WANT=4.2.1
SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PREFIX=${CRIU_PREFIX:-/usr/local}

patches=$(cd "$(dirname "$0")/criu-patches" && pwd)
# each patch's own message marks a binary built with it
markers=('rlimit %d from /proc/%d/limits' '#PF at 0x%llx: asking for %llu bytes, background stays at %lu'
  'background: %lu pages at 0x%lx, up to %d requests in flight'
  'answer for 0x%lx of %lu taken ahead of %d earlier requests' 'fault-around: %lu pages at 0x%lx'
  'page at %lx holds a stack pointer: not lazy' 'runs of pages merged: the longest is %lu bytes'
  'dropping %llu bytes of ranges at %llx' 'remap: %d requests in flight asked for again at the new place'
  'copy refused while the memory map changed' 'copier: %d events read while waiting for a buffer'
  'lazy-pages: answers in shared memory of %lu bytes'
  'lazy-pages: slept %lu times while nothing was to ask for'
  'lazy-pages: following a forked process'
  'lazy-pages: %lu zero pages mapped, not asked for'
  'lazy-pages: up to %d background requests in flight')
have=$(criu --version 2>/dev/null | awk '/^Version:/{print $2}' || true)
patched() {
  local m
  for m in "${markers[@]}"; do grep -qaF "$m" "$1" || return 1; done
}
if [ -n "$have" ] && [ "$(printf '%s\n4.2\n' "$have" | sort -V | head -1)" = "4.2" ] \
  && patched "$(command -v criu)"; then
  echo "criu $have already installed"; exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends build-essential patch pkg-config curl xz-utils \
  libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libprotobuf-dev \
  libnl-3-dev libnet1-dev libcap-dev uuid-dev libbsd-dev libnftables-dev \
  python3-protobuf nftables iproute2 >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL -o "$work/criu.tar.xz" "$MIRROR/pool/main/c/criu/criu_${WANT}.orig.tar.xz"
echo "$SHA256  $work/criu.tar.xz" | sha256sum -c - >/dev/null
tar -C "$work" -xJf "$work/criu.tar.xz"
src=$(find "$work" -maxdepth 1 -type d -name 'criu-*' | head -1)
for p in "$patches"/*.patch; do patch -s -d "$src" -p1 <"$p"; done
make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
# a rename, so that a criu running meanwhile keeps its binary
install -D -m 0755 "$src/criu/criu" "$PREFIX/sbin/.criu.new"
mv -f "$PREFIX/sbin/.criu.new" "$PREFIX/sbin/criu"
mkdir -p /etc/criu
grep -qs '^network-lock' /etc/criu/default.conf || echo 'network-lock nftables' >>/etc/criu/default.conf
echo "installed $("$PREFIX/sbin/criu" --version | head -1) to $PREFIX/sbin/criu"

#!/bin/sh
# Build a local stand-in for python:3.11-slim from Debian's own packages, for machines
# that reach Debian's mirror but no image registry: debootstrap a minimal bookworm with
# python3 and python3-venv, then `docker import` it. Does nothing if the image exists.
#   usage: tests/docker/build-base.sh [IMAGE]   (default whoseturn-base:bookworm)
set -eu
image=${1:-whoseturn-base:bookworm}
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image: cached"
  exit 0
fi
# The mirror apt already uses here (deb822 sources first, then the one-line form).
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | grep -v security | head -n 1)
if [ -z "$mirror" ]; then
  mirror=$(awk '$1 == "deb" && $0 !~ /security/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" >/dev/null
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | docker import -c 'CMD ["python3"]' - "$image" >/dev/null
echo "base image $image: built"

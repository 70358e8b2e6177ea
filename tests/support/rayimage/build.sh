#!/usr/bin/env bash
# Builds the Ray runtime test bundle image as a root file system tar (no registry needed):
# debootstrap (minbase) + a venv at /opt/ray with ray[serve]==2.58.0 and jinja2 from the package
# index + the test image's helper CLI `llm-port-ray-runtime` (helper.py beside this script).
#
# Cached by content hash under a fixed directory ($LLMPORT_RAY_IMAGE_CACHE, default
# /var/cache/llmport-tests/ray-image): the base (debootstrap + venv) by the hash of this
# script's recipe, the final tar by that plus the helper's hash, so a rerun is instant and a
# helper change costs seconds. Prints the path of the final tar on its last line.
# Needs root and debootstrap. Usage: build.sh [--print-path]  (--print-path: no build; the
# path the tar will have, whether or not it exists)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${LLMPORT_RAY_IMAGE_CACHE:-/var/cache/llmport-tests/ray-image}
RAY_VERSION=2.58.0
SUITE=bookworm
recipe="v1 suite=$SUITE ray=$RAY_VERSION pkgs=python3,python3-venv,procps,ca-certificates extra=jinja2"
base_key=$(printf '%s' "$recipe" | sha256sum | cut -c1-16)
# The top layer: the helper, and python3 on PATH running the venv's interpreter (as in a real
# runtime image, where `python3 -` imports ray: describe_ray_cluster's inspection program).
stage_recipe="v2 python3=/opt/ray/bin/python3"
helper_key=$( (cat "$here/helper.py"; printf '%s' "$stage_recipe") | sha256sum | cut -c1-16)
final="$cache/ray-$RAY_VERSION-$base_key-$helper_key.tar"
if [ "${1:-}" = "--print-path" ]; then echo "$final"; exit 0; fi
if [ -s "$final" ]; then echo "$final"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "building the Ray test image needs root (debootstrap, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 2; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [ -s "$final" ]; then echo "$final"; exit 0; fi
base="$cache/base-$base_key.tar"
if [ ! -s "$base" ]; then
  work=$(mktemp -d "$cache/work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "== debootstrap $SUITE from $mirror" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,procps,ca-certificates \
    "$SUITE" "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  echo "== pip download ray[serve]==$RAY_VERSION jinja2" >&2
  mkdir -p "$cache/wheels" "$work/root/tmp/wheels"
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$cache/wheels" "ray[serve]==$RAY_VERSION" jinja2 2>&1 | grep -v '^WARNING: Location' >&2 || true
  cp "$cache"/wheels/*.whl "$work/root/tmp/wheels/"
  echo "== venv /opt/ray" >&2
  # A clean environment in the chroot: the host's PIP_* settings point at host paths.
  in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$work/root" "$@"; }
  in_root python3 -m venv /opt/ray
  in_root /opt/ray/bin/pip install -q --disable-pip-version-check --no-index \
    --find-links /tmp/wheels "ray[serve]==$RAY_VERSION" jinja2 >&2
  rm -rf "$work/root/tmp/wheels" "$work/root/var/cache/apt/archives/"*.deb "$work/root/root/.cache"
  for b in ray serve; do ln -sf "/opt/ray/bin/$b" "$work/root/usr/local/bin/$b"; done
  tar -C "$work/root" -cf "$work/base.tar" .
  mv "$work/base.tar" "$base"
  rm -rf "$work"; trap - EXIT
fi
echo "== helper $helper_key" >&2
stage=$(mktemp -d "$cache/helper.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/usr/local/bin"
install -m 0755 "$here/helper.py" "$stage/usr/local/bin/llm-port-ray-runtime"
# A wrapper, not a link: the venv is found from the path the interpreter is started by.
printf '#!/bin/sh\nexec /opt/ray/bin/python3 "$@"\n' >"$stage/usr/local/bin/python3"
chmod 0755 "$stage/usr/local/bin/python3"
cp "$base" "$final.tmp"
tar -C "$stage" -rf "$final.tmp" ./usr/local/bin/llm-port-ray-runtime ./usr/local/bin/python3
mv "$final.tmp" "$final"
# Older finals of this base are superseded by this helper.
for f in "$cache"/ray-$RAY_VERSION-$base_key-*.tar; do [ "$f" = "$final" ] || rm -f "$f"; done
echo "$final"

#!/usr/bin/env bash
# Installs what the project needs and is missing: the Debian packages and a Python
# environment with the pinned torch (LibTorch) and neml2 (the model compiler).
# Idempotent; source it to get NEML2_DISPATCH_VENV and NEML2_DISPATCH_CACHE.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

export NEML2_DISPATCH_CACHE="${NEML2_DISPATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/neml2-dispatch}"

# clang and libclang-rt-14-dev (libFuzzer) only for scripts/fuzz.sh; doxygen for the API
# reference (the docs_api test).
debian_packages=(cmake g++ libfmt-dev nlohmann-json3-dev doctest-dev libcli11-dev libbenchmark-dev
                 libopenmpi-dev openmpi-bin clang libclang-rt-14-dev doxygen)
# python3-venv only where the system python lacks venv (pyenv builds have it).
python3 -c 'import venv, ensurepip' 2>/dev/null || debian_packages+=(python3-venv)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# One environment per (python version, requirements): reused across clones and CI runs.
py_version="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
key="$( (echo "$py_version"; cat "$root/requirements.txt") | sha256sum | cut -c1-12)"
export NEML2_DISPATCH_VENV="$NEML2_DISPATCH_CACHE/venv-py$py_version-$key"
if [ ! -f "$NEML2_DISPATCH_VENV/.complete" ]; then
  echo "setup: creating $NEML2_DISPATCH_VENV (torch and neml2 from PyPI; a few GB, once)"
  rm -rf "$NEML2_DISPATCH_VENV"
  mkdir -p "$NEML2_DISPATCH_CACHE"
  python3 -m venv "$NEML2_DISPATCH_VENV"
  "$NEML2_DISPATCH_VENV/bin/pip" install -q --upgrade pip
  "$NEML2_DISPATCH_VENV/bin/pip" install -q -r "$root/requirements.txt"
  touch "$NEML2_DISPATCH_VENV/.complete"
fi

# What the Python module's wheel and tests need (python/requirements.txt), in a step of its
# own: the environment's hash above covers only requirements.txt, so this file can change
# without rebuilding the environment (and downloading torch again).
python_key="$(sha256sum "$root/python/requirements.txt" | cut -c1-12)"
if [ ! -f "$NEML2_DISPATCH_VENV/.python-$python_key" ]; then
  echo "setup: installing python/requirements.txt into $NEML2_DISPATCH_VENV"
  "$NEML2_DISPATCH_VENV/bin/pip" install -q -r "$root/python/requirements.txt"
  touch "$NEML2_DISPATCH_VENV/.python-$python_key"
fi

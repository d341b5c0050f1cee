#!/usr/bin/env bash
# Build the framework-integration environment: the pinned packages of requirements.lock go once into a cache
# directory keyed by the lock's hash (installed with --no-deps: no resolver, nothing CUDA), and each fresh
# venv reads them through a .pth file; only this project is installed into the venv itself (editable, so the
# verl.plugins entry point is registered), and slime's reward code, which is not on PyPI, is read from its
# source files in tests/integrations/slime_src (see the README there). A second run on the same machine takes
# seconds.
set -euo pipefail
venv=$1 lock=$2 cache=$3 py=${4:-python3}
# A directory named site-packages: datasets/dill pickle code by reference only from such paths.
deps="$cache/$(sha256sum "$lock" | cut -c1-16)/site-packages"
if [ ! -f "$deps/.complete" ]; then
  echo "integrations: installing $(grep -c '==' "$lock") pinned packages into $deps (once per lock)"
  rm -rf "$deps.tmp" && mkdir -p "$deps.tmp"
  start=$(date +%s)
  "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$deps.tmp" -r "$lock"
  echo "integrations: installed in $(( $(date +%s) - start ))s"
  touch "$deps.tmp/.complete"
  rm -rf "$deps" && mv "$deps.tmp" "$deps"
fi
rm -rf "$venv"
"$py" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$deps')" > "$site/rewardmesh_integrations_deps.pth"
# slime 0.3.1 from source, as `pip install -e` would put it on the path.
echo "$(cd "$(dirname "$0")" && pwd)/slime_src" > "$site/slime_src.pth"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
touch "$venv/.installed"

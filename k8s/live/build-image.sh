#!/bin/bash
# The project's CPU image without Docker: a Debian 12 rootfs (mmdebstrap) with the Dockerfile's runtime packages, a
# venv at /opt/venv with the CPU torch and the project (otlp and demo extras), the Dockerfile's user and config,
# packed as a docker-archive for `ctr images import`. Inputs come from the Dockerfile and .dockerignore (image.py).
# Cached in $KCACHE/image: the rootfs with the dependencies (rebuilt when pyproject.toml or the package list
# changes), and the finished image (rebuilt when anything it is built from changes).
# Usage: build-image.sh  -> prints the path of the image archive on its last line
source "$(dirname "$0")/lib.sh"

TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
IMG=$KCACHE/image
# Commands in the image's root run with a clean environment: nothing of this machine's (pip settings) leaks in.
inroot() {
	local root=$1
	shift
	env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$root" "$@"
}
mkdir -p "$IMG/wheels" "$IMG/logs"
key=$("$PY" "$LIVE_DIR/image.py" key)
out=$IMG/rewardmesh-$key.tar
if [ -f "$out" ]; then
	echo "image up to date: $out"
	echo "$out"
	exit 0
fi

work=$IMG/work-$key
rm -rf "$work" && mkdir -p "$work/context" "$work/wheel"
"$PY" "$LIVE_DIR/image.py" files "$work/context"
# The project's wheel from the build context, as `pip install .` in the Dockerfile builds it.
"$PY" -m pip wheel -q --no-deps "$work/context" -w "$work/wheel" >"$IMG/logs/pip-wheel.log" 2>&1
wheel=$(ls "$work/wheel"/rewardmesh-*.whl)

packages=$("$PY" "$LIVE_DIR/image.py" packages)
deps_key=$( (echo "$packages python3.11-venv $TORCH_SPEC"; cat "$REPO_ROOT/pyproject.toml") | sha256sum | cut -c1-16)
deps=$IMG/deps-$deps_key
if [ ! -f "$deps/.done" ]; then
	rm -rf "$deps"
	echo "building the dependency rootfs (Debian packages, CPU torch, the project's requirements) in $deps"
	# python3.11-venv: the Dockerfile makes its venv in a build stage; here it is made in place.
	mmdebstrap --variant=minbase --include="${packages// /,},python3.11-venv" bookworm "$deps" \
		>"$IMG/logs/mmdebstrap.log" 2>&1
	"$PY" -m pip download -q -d "$IMG/wheels" "$TORCH_SPEC" "$wheel[otlp,demo]" >"$IMG/logs/pip-download.log" 2>&1
	mkdir -p "$deps/wheels"
	mount --bind "$IMG/wheels" "$deps/wheels"
	trap 'umount "$deps/wheels" 2>/dev/null || true' EXIT
	inroot "$deps" python3.11 -m venv /opt/venv
	inroot "$deps" /opt/venv/bin/pip install -q --no-index --find-links /wheels "$TORCH_SPEC" \
		"rewardmesh[otlp,demo]" >"$IMG/logs/chroot-pip.log" 2>&1
	inroot "$deps" /opt/venv/bin/pip uninstall -q -y rewardmesh >>"$IMG/logs/chroot-pip.log" 2>&1
	umount "$deps/wheels" && trap - EXIT && rmdir "$deps/wheels"
	rm -rf "$deps/var/lib/apt/lists"/* "$deps/var/cache/apt"/*.bin "$deps/root/.cache"
	touch "$deps/.done"
fi

echo "building the image from $deps and the project's wheel"
root=$work/rootfs
cp -a "$deps" "$root"
rm -f "$root/.done"
cp "$wheel" "$root/tmp/"
inroot "$root" /opt/venv/bin/pip install -q --no-index --no-deps "/tmp/$(basename "$wheel")" >"$IMG/logs/project-pip.log" 2>&1
rm -f "$root/tmp/$(basename "$wheel")"
# As the Dockerfile: the non-root user the manifests run as (uid/gid 1000).
inroot "$root" groupadd --gid 1000 rewardmesh
inroot "$root" useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rewardmesh --shell /usr/sbin/nologin \
	rewardmesh
inroot "$root" /opt/venv/bin/python -c "import rewardmesh.server.cli, rewardmesh.client.trainer, rewardmesh.v1.reward_pb2_grpc"
inroot "$root" /opt/venv/bin/rewardmesh --help >/dev/null
tar --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
"$PY" "$LIVE_DIR/image.py" pack "$work/rootfs.tar" "$out.tmp" "docker.io/library/rewardmesh:0.1.0"
mv "$out.tmp" "$out"
rm -rf "$work"
# Older images of this checkout are not needed again.
find "$IMG" -maxdepth 1 -name 'rewardmesh-*.tar' ! -name "$(basename "$out")" -delete
echo "$out"

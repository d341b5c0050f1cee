#!/bin/bash
# Builds kube-apiserver, kubelet, kube-scheduler, kube-controller-manager, kube-proxy and kubectl v1.20.2 from
# Debian's source package `kubernetes` (the full tree with vendor/) with Debian's Go, offline, once per machine.
# The binaries land in $KCACHE/bin; a second run finds them and returns at once.
source "$(dirname "$0")/lib.sh"

WHAT=(cmd/kube-apiserver cmd/kubelet cmd/kube-scheduler cmd/kube-controller-manager cmd/kube-proxy cmd/kubectl)
BIN=$KCACHE/bin
done_all=1
for w in "${WHAT[@]}"; do [ -x "$BIN/$(basename "$w")" ] || done_all=0; done
[ -x "$BIN/pause" ] || done_all=0
if [ $done_all = 1 ]; then
	echo "kubernetes $K8S_VERSION binaries cached in $BIN"
	exit 0
fi

SRC=$KCACHE/src
mkdir -p "$SRC" "$BIN"
if [ ! -d "$SRC/tree" ]; then
	# apt-get source needs a deb-src entry with the same URIs and suites as the binary sources.
	if ! apt-get indextargets --format '$(CREATED_BY)' 2>/dev/null | grep -q '^Sources$'; then
		sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
			>/etc/apt/sources.list.d/rewardmesh-deb-src.sources
		apt-get update -qq
	fi
	rm -rf "$SRC/dl" && mkdir -p "$SRC/dl"
	(cd "$SRC/dl" && apt-get source --download-only -qq kubernetes && dpkg-source -x --no-check ./*.dsc tree >/dev/null)
	mv "$SRC/dl/tree" "$SRC/tree"
	rm -rf "$SRC/dl"
fi

# The Kubernetes Makefile expects the GOPATH layout; the code generators it runs first need rsync.
mkdir -p "$SRC/gopath/src/k8s.io"
ln -sfn "$SRC/tree" "$SRC/gopath/src/k8s.io/kubernetes"
cd "$SRC/gopath/src/k8s.io/kubernetes"
export GOPATH=$SRC/gopath GOCACHE=$SRC/gocache HOME=$SRC/home GOPROXY=off CGO_ENABLED=0
export KUBE_GIT_VERSION=$K8S_VERSION KUBE_GIT_TREE_STATE=clean KUBE_BUILD_PLATFORMS=linux/amd64
mkdir -p "$HOME"
nice make WHAT="${WHAT[*]}" GOFLAGS=-p=2 GOLDFLAGS="-s -w"
for w in "${WHAT[@]}"; do cp "_output/local/bin/linux/amd64/$(basename "$w")" "$BIN/"; done

# The pod sandbox ("pause") image's program, from the same tree: no registry to pull it from.
gcc -static -O2 -o "$BIN/pause" build/pause/linux/pause.c
echo "kubernetes $K8S_VERSION binaries built into $BIN"

#!/bin/bash
# Installs the Debian packages the live node needs (root with apt): Go to build Kubernetes, etcd, containerd, runc,
# the CNI plugins, iptables for kube-proxy, mmdebstrap for the image, dnsmasq for cluster DNS.
source "$(dirname "$0")/lib.sh"

PKGS=(golang-go etcd-server containerd runc containernetworking-plugins iptables conntrack mmdebstrap rsync
	dnsmasq-base dpkg-dev openssl curl gcc libc6-dev make bubblewrap uidmap)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	[ "$(id -u)" = 0 ] || { echo "needs root to install: ${missing[*]}" >&2; exit 1; }
	echo "installing: ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

#!/bin/bash
# A live one-node Kubernetes v1.20.2 cluster on this machine, for the live-node tests (tests/cluster).
#
#   cluster.sh up      build or reuse the binaries and the image, start every component, wait for the node
#   cluster.sh down    stop every component this script started (by pid), remove its pods, mounts and links
#   cluster.sh run CMD...   up, run CMD with KUBECONFIG set, down whatever happens (make test-cluster)
#   cluster.sh shell   up, then wait (Ctrl-C tears it down): make cluster-up
#
# Every component is a process of its own, its pid in $RUN_DIR/pids and its log in $RUN_DIR/logs: etcd, the
# kube-apiserver on 127.0.0.1:6443 (token auth), containerd (own socket and state), kube-scheduler,
# kube-controller-manager, kube-proxy (iptables), dnsmasq with dns_sync.py (the cluster DNS: *.svc.cluster.local
# from Services and Endpoints), and the kubelet. The node's address is 192.0.2.2 on a veth link of its own, pods
# are on the bridge rmcni0 (10.244.0.0/24); nothing listens beyond this machine's own addresses.
source "$(dirname "$0")/lib.sh"

NODE_NAME=live-node
NODE_IP=192.0.2.2
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/16
BRIDGE=rmcni0
NODE_LINK=rmnode0
CNI_NET=rewardmesh-live
SECCOMP_ROOT=/var/lib/kubelet/seccomp
# Alpha in 1.20: procMount Unmasked, which the code sandbox's bubblewrap needs to mount its own /proc.
FEATURES=--feature-gates=ProcMountType=true
BIN=$KCACHE/bin
PIDS=$RUN_DIR/pids
KUBECONFIG_FILE=$RUN_DIR/kubeconfig
CTR=(ctr --address "$RUN_DIR/containerd.sock" -n k8s.io)

# "start NAME CMD...": a component in the background, its pid recorded, its output in its log.
start() {
	local name=$1
	shift
	"$@" >"$LOGS/$name.log" 2>&1 &
	echo $! >"$PIDS/$name.pid"
}

# "logged NAME CMD...": CMD with its output in $LOGS/NAME.log (for the stages that are not one daemon).
logged() {
	local name=$1
	shift
	"$@" >"$LOGS/$name.log" 2>&1
}

alive() { [ -f "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

kctl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

api_ready() { curl -skf -H "Authorization: Bearer $(cat "$RUN_DIR/pki/admin-token")" https://127.0.0.1:6443/readyz; }

pki() {
	mkdir -p "$RUN_DIR/pki"
	openssl rand -hex 24 >"$RUN_DIR/pki/admin-token"
	echo "$(cat "$RUN_DIR/pki/admin-token"),admin,admin,system:masters" >"$RUN_DIR/pki/tokens.csv"
	openssl genrsa -out "$RUN_DIR/pki/sa.key" 2048 2>/dev/null
	openssl rsa -in "$RUN_DIR/pki/sa.key" -pubout -out "$RUN_DIR/pki/sa.pub" 2>/dev/null
	cat >"$KUBECONFIG_FILE" <<-EOF
		apiVersion: v1
		kind: Config
		clusters: [{name: live, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
		users: [{name: admin, user: {token: "$(cat "$RUN_DIR/pki/admin-token")"}}]
		contexts: [{name: live, context: {cluster: live, user: admin}}]
		current-context: live
	EOF
	# Pods get the cluster DNS and nothing else: no search domains or resolvers of this machine.
	: >"$RUN_DIR/resolv.conf"
}

network() {
	# A veth pair of its own (this kind of VM has no dummy links): the node's address on one end, both up.
	ip link del "$NODE_LINK" 2>/dev/null || true # what a killed run left
	ip link add "$NODE_LINK" type veth peer name "$NODE_LINK-peer"
	ip addr add "$NODE_IP/32" dev "$NODE_LINK"
	ip link set "$NODE_LINK-peer" up
	ip link set "$NODE_LINK" up
	# Service addresses that kube-proxy has not rewritten (a Service with no endpoints yet) go to that link and end
	# there, never out through the machine's default route; the route goes with the link at teardown.
	ip route replace "$SERVICE_CIDR" dev "$NODE_LINK"
	mkdir -p "$RUN_DIR/cni"
	cat >"$RUN_DIR/cni/10-rewardmesh.conflist" <<-EOF
		{"cniVersion": "0.4.0", "name": "$CNI_NET", "plugins": [
		  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
		   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
		  {"type": "portmap", "capabilities": {"portMappings": true}}]}
	EOF
}

etcd_up() {
	mkdir -p "$RUN_DIR/etcd"
	start etcd etcd --data-dir "$RUN_DIR/etcd" --listen-client-urls http://127.0.0.1:2379 \
		--advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
		--initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster default=http://127.0.0.1:2380
	wait_for 60 "etcd" curl -sf http://127.0.0.1:2379/health
}

apiserver_up() {
	start apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
		--token-auth-file="$RUN_DIR/pki/tokens.csv" --secure-port=6443 --bind-address=127.0.0.1 \
		--advertise-address=127.0.0.1 --cert-dir="$RUN_DIR/certs" --insecure-port=0 \
		--service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$RUN_DIR/pki/sa.pub" \
		--service-account-signing-key-file="$RUN_DIR/pki/sa.key" --api-audiences=https://kubernetes.default.svc \
		--service-cluster-ip-range="$SERVICE_CIDR" --authorization-mode=Node,RBAC --allow-privileged=true \
		--kubelet-preferred-address-types=InternalIP "$FEATURES"
	wait_for 180 "the API server's /readyz" api_ready
}

containerd_up() {
	mkdir -p "$KCACHE/containerd" "$RUN_DIR/containerd-state"
	cat >"$RUN_DIR/containerd.toml" <<-EOF
		version = 2
		root = "$KCACHE/containerd"
		state = "$RUN_DIR/containerd-state"
		[grpc]
		  address = "$RUN_DIR/containerd.sock"
		[plugins."io.containerd.grpc.v1.cri"]
		  sandbox_image = "localhost/pause:1"
		  # This kind of VM refuses a lowered oom_score_adj; runc fails without this.
		  restrict_oom_score_adj = true
		  disable_tcp_service = true
		  stream_server_address = "127.0.0.1"
		  [plugins."io.containerd.grpc.v1.cri".cni]
		    bin_dir = "/usr/lib/cni"
		    conf_dir = "$RUN_DIR/cni"
		  [plugins."io.containerd.grpc.v1.cri".containerd]
		    snapshotter = "overlayfs"
		    default_runtime_name = "runc"
		    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
		      runtime_type = "io.containerd.runc.v2"
	EOF
	start containerd containerd --config "$RUN_DIR/containerd.toml"
	wait_for 60 "containerd's socket" "${CTR[@]}" version
	# Whatever an earlier run left behind (its pods ran against another API server) goes first.
	remove_containers
}

# The images live in containerd's root (kept between runs): import only what changed.
images_up() {
	local image key_file=$KCACHE/containerd/.rewardmesh-image
	image=$(bash "$LIVE_DIR/build-image.sh" | tail -n 1)
	if ! "${CTR[@]}" images ls -q | grep -qx localhost/pause:1; then
		local p=$RUN_DIR/pause
		mkdir -p "$p/root"
		cp "$BIN/pause" "$p/root/pause"
		tar --numeric-owner -C "$p/root" -cf "$p/rootfs.tar" .
		"$PY" "$LIVE_DIR/image.py" pack "$p/rootfs.tar" "$p/pause.tar" localhost/pause:1 \
			--entrypoint '["/pause"]' --no-user
		"${CTR[@]}" images import "$p/pause.tar" >/dev/null
	fi
	if [ "$(cat "$key_file" 2>/dev/null)" != "$image" ] ||
		! "${CTR[@]}" images ls -q | grep -qx docker.io/library/rewardmesh:0.1.0; then
		"${CTR[@]}" images import "$image" >/dev/null
		echo "$image" >"$key_file"
	fi
	# The images an earlier build left (replaced under the same tag) go, so the cache does not grow.
	bash "$LIVE_DIR/prune-images.sh" "$RUN_DIR/containerd.sock" docker.io/library/rewardmesh:0.1.0 localhost/pause:1
}

control_plane_up() {
	local k=$KUBECONFIG_FILE
	start scheduler "$BIN/kube-scheduler" --kubeconfig="$k" --authentication-kubeconfig="$k" \
		--authorization-kubeconfig="$k" --leader-elect=false --bind-address=127.0.0.1 --port=0 "$FEATURES"
	start controller-manager "$BIN/kube-controller-manager" --kubeconfig="$k" --authentication-kubeconfig="$k" \
		--authorization-kubeconfig="$k" --leader-elect=false --bind-address=127.0.0.1 --port=0 \
		--service-account-private-key-file="$RUN_DIR/pki/sa.key" --root-ca-file="$RUN_DIR/certs/apiserver.crt" \
		--use-service-account-credentials=false --cluster-cidr="$POD_CIDR" \
		--service-cluster-ip-range="$SERVICE_CIDR" "$FEATURES"
	wait_for 120 "the default ServiceAccount" kctl -n default get serviceaccount default
}

dns_up() {
	mkdir -p "$RUN_DIR/dns"
	: >"$RUN_DIR/dns/hosts"
	# Answers *.cluster.local from the hosts file only (NXDOMAIN otherwise), nothing else: no upstream.
	start dnsmasq dnsmasq --keep-in-foreground --no-resolv --no-hosts --addn-hosts="$RUN_DIR/dns/hosts" \
		--local=/cluster.local/ --bind-interfaces --listen-address="$NODE_IP" \
		--local-ttl=1 --neg-ttl=1 --pid-file= --log-facility=-
	start dns-sync "$PY" "$LIVE_DIR/dns_sync.py" --kubeconfig "$KUBECONFIG_FILE" \
		--hosts "$RUN_DIR/dns/hosts" --dnsmasq-pid "$(cat "$PIDS/dnsmasq.pid")"
	wait_for 60 "the cluster DNS" grep -q 'kubernetes.default.svc.cluster.local' "$RUN_DIR/dns/hosts"
}

proxy_up() {
	# --masquerade-all: pods on one bridge reach each other's Services without br_netfilter.
	start kube-proxy "$BIN/kube-proxy" --kubeconfig="$KUBECONFIG_FILE" --hostname-override="$NODE_NAME" \
		--proxy-mode=iptables --cluster-cidr="$POD_CIDR" --masquerade-all --conntrack-max-per-core=0 \
		--bind-address=127.0.0.1 --healthz-bind-address=127.0.0.1:10256 --metrics-bind-address=127.0.0.1:10249
	wait_for 60 "kube-proxy's rules" iptables -t nat -S KUBE-SERVICES
}

kubelet_up() {
	mkdir -p "$RUN_DIR/kubelet" "$SECCOMP_ROOT"
	start kubelet "$BIN/kubelet" --kubeconfig="$KUBECONFIG_FILE" --container-runtime=remote \
		--container-runtime-endpoint="unix://$RUN_DIR/containerd.sock" --cgroup-driver=cgroupfs \
		--fail-swap-on=false --root-dir="$RUN_DIR/kubelet" --cert-dir="$RUN_DIR/kubelet-pki" \
		--hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --address="$NODE_IP" --read-only-port=0 \
		--healthz-bind-address=127.0.0.1 --cgroups-per-qos=false --enforce-node-allocatable="" \
		--eviction-hard="" --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
		--pod-infra-container-image=localhost/pause:1 --resolv-conf="$RUN_DIR/resolv.conf" \
		--cluster-dns="$NODE_IP" --cluster-domain=cluster.local --seccomp-profile-root="$SECCOMP_ROOT" \
		--serialize-image-pulls=false "$FEATURES"
	wait_for 180 "the node to be Ready" node_ready
}

node_ready() { kctl get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' | grep -qx True; }

remove_containers() {
	local ids
	ids=$("${CTR[@]}" tasks ls -q 2>/dev/null || true)
	for id in $ids; do "${CTR[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
	for id in $ids; do "${CTR[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true; done
	ids=$("${CTR[@]}" containers ls -q 2>/dev/null || true)
	for id in $ids; do "${CTR[@]}" containers delete "$id" >/dev/null 2>&1 || true; done
}

# The rules and chains the kubelet and kube-proxy made (KUBE-*), and the jumps to them from the built-in chains.
clean_iptables() {
	local cmd t rules rule chains c
	for cmd in iptables ip6tables; do
		command -v "$cmd" >/dev/null || continue
		for t in filter nat mangle; do
			rules=$("$cmd" -t "$t" -S 2>/dev/null | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j KUBE-' || true)
			while IFS= read -r rule; do
				[ -n "$rule" ] && eval "$cmd -t $t -D ${rule#-A }" 2>/dev/null || true
			done <<<"$rules"
			chains=$("$cmd" -t "$t" -S 2>/dev/null | awk '/^-N KUBE-/ {print $2}')
			for c in $chains; do "$cmd" -t "$t" -F "$c" 2>/dev/null || true; done
			for c in $chains; do "$cmd" -t "$t" -X "$c" 2>/dev/null || true; done
		done
	done
}

# Every pod's veth on the cluster's bridge and the network namespace at its other end (containerd made them;
# the pods were removed under it, not through CNI).
clean_pod_networks() {
	local veth ns
	for veth in $(ip -o link show master "$BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
		ns=$(ip -o link show "$veth" 2>/dev/null | grep -o 'link-netns [^ ]*' | cut -d' ' -f2 || true)
		ip link del "$veth" 2>/dev/null || true
		[ -n "$ns" ] && ip netns delete "$ns" 2>/dev/null || true
	done
	# And the namespaces containerd made for pods it has removed but left behind (named cni-*, made since the
	# cluster started).
	for ns in $(find /run/netns -maxdepth 1 -name 'cni-*' -newer "$RUN_DIR/pki/tokens.csv" -printf '%f\n' 2>/dev/null); do
		ip netns delete "$ns" 2>/dev/null || true
	done
}

stop_pid() {
	local name=$1 pid
	[ -f "$PIDS/$name.pid" ] || return 0
	pid=$(cat "$PIDS/$name.pid")
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$PIDS/$name.pid"
}

down() {
	case "$RUN_DIR" in /*/*) ;; *) echo "refusing to tear down RUN_DIR='$RUN_DIR'" >&2; return 1 ;; esac
	[ -d "$RUN_DIR" ] || return 0
	echo "[cluster] tearing down"
	# The pods first (the kubelet would restart them), then every component in reverse order of start.
	stop_pid kubelet
	if alive containerd; then
		remove_containers
	fi
	for name in kube-proxy dns-sync dnsmasq controller-manager scheduler containerd apiserver etcd; do
		stop_pid "$name"
	done
	clean_iptables
	# What the pods left: their network namespaces and links, volume mounts, the bridge, the IP allocations.
	clean_pod_networks
	local mounts
	mounts=$(findmnt -rn -o TARGET | grep "^$RUN_DIR/" | sort -r || true)
	for m in $mounts; do umount -l "$m" 2>/dev/null || true; done
	ip link del "$BRIDGE" 2>/dev/null || true
	ip link del "$NODE_LINK" 2>/dev/null || true
	rm -rf "/var/lib/cni/networks/$CNI_NET" "/var/lib/cni/results/$CNI_NET"-* 2>/dev/null || true
	rm -rf "$RUN_DIR"
	echo "[cluster] down"
}

up() {
	if [ -d "$PIDS" ] && ls "$PIDS"/*.pid >/dev/null 2>&1; then
		echo "[cluster] a cluster is already up in $RUN_DIR: run '$0 down' first" >&2
		return 1
	fi
	rm -rf "$RUN_DIR"
	mkdir -p "$RUN_DIR" "$LOGS" "$PIDS"
	local t0=$SECONDS
	stage "packages" "" bash "$LIVE_DIR/deps.sh"
	stage "kubernetes binaries" "$LOGS/build.log" logged build bash "$LIVE_DIR/build-kubernetes.sh"
	stage "keys and kubeconfig" "" pki
	stage "node network" "" network
	stage "etcd" "$LOGS/etcd.log" etcd_up
	stage "kube-apiserver" "$LOGS/apiserver.log" apiserver_up
	stage "containerd" "$LOGS/containerd.log" containerd_up
	stage "images" "$LOGS/images.log" logged images images_up
	stage "scheduler, controller-manager" "$LOGS/controller-manager.log" control_plane_up
	stage "cluster DNS" "$LOGS/dns-sync.log" dns_up
	stage "kube-proxy" "$LOGS/kube-proxy.log" proxy_up
	stage "kubelet, node Ready" "$LOGS/kubelet.log" kubelet_up
	echo "[cluster] up in $((SECONDS - t0))s: export KUBECONFIG=$KUBECONFIG_FILE (logs in $LOGS)"
}

case "${1:-}" in
up)
	trap 'rc=$?; [ $rc -eq 0 ] || down; exit $rc' EXIT
	up
	;;
down)
	down
	;;
run)
	shift
	trap 'down' EXIT
	trap 'exit 130' INT TERM
	up
	REWARDMESH_LIVE_CLUSTER=1 KUBECONFIG=$KUBECONFIG_FILE REWARDMESH_CLUSTER_DIR=$RUN_DIR PATH=$BIN:$PATH "$@"
	;;
shell)
	trap 'down' EXIT
	trap 'exit 130' INT TERM
	up
	echo "[cluster] running; Ctrl-C tears it down"
	while alive kubelet && alive apiserver; do sleep 5; done
	echo "[cluster] a component exited" >&2
	exit 1
	;;
*)
	echo "usage: $0 up|down|run CMD...|shell" >&2
	exit 2
	;;
esac

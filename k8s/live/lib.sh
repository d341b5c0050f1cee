# Shared by the live-node scripts: where things are cached and kept, and how a stage reports itself.
# Sourced, not run.
set -euo pipefail

K8S_VERSION=v1.20.2
CACHE_ROOT=${REWARDMESH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rewardmesh}
# The Kubernetes binaries and the images, built once per machine, outside the checkout.
KCACHE=$CACHE_ROOT/k8s-$K8S_VERSION
# One cluster's state (etcd, containerd, kubelet, logs, pids); removed by cluster-down.
RUN_DIR=${REWARDMESH_CLUSTER_DIR:-/tmp/rewardmesh-cluster}
LOGS=$RUN_DIR/logs
LIVE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$LIVE_DIR/../.." && pwd)
# The project's venv (make install): its pip builds the image's wheels, its Python runs the helpers.
PY=${REWARDMESH_PYTHON:-$REPO_ROOT/.venv/bin/python}

# "stage NAME LOG CMD...": one progress line per stage; on failure the last lines of the component's log.
stage() {
	local name=$1 log=$2 t0 rc
	shift 2
	t0=$(date +%s)
	printf '[cluster] %-28s ...\n' "$name"
	# In a subshell with errexit on, so any failing command fails the stage.
	set +e
	(
		set -e
		"$@"
	)
	rc=$?
	set -e
	if [ $rc -ne 0 ]; then
		printf '[cluster] %-28s FAILED (exit %s) after %ss\n' "$name" "$rc" "$(($(date +%s) - t0))" >&2
		if [ -n "$log" ] && [ -f "$log" ]; then
			echo "[cluster] last lines of $log:" >&2
			tail -n 40 "$log" | sed 's/^/    /' >&2
		fi
		return $rc
	fi
	printf '[cluster] %-28s ok (%ss)\n' "$name" "$(($(date +%s) - t0))"
}

# "wait_for SECONDS DESCRIPTION CMD...": polls CMD until it succeeds; a condition, never a fixed sleep.
wait_for() {
	local limit=$1 what=$2 deadline
	shift 2
	deadline=$(($(date +%s) + limit))
	until "$@" >/dev/null 2>&1; do
		if [ "$(date +%s)" -ge "$deadline" ]; then
			echo "timed out after ${limit}s waiting for $what" >&2
			return 1
		fi
		sleep 1
	done
}

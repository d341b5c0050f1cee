#!/bin/bash
# Removes from containerd every image but the ones named (by reference), so that images replaced by newer builds
# (the same tag, and the image-id names the kubelet's runtime adds) are garbage-collected and the cache does not
# grow with every rebuild. Usage: prune-images.sh SOCKET REF...
source "$(dirname "$0")/lib.sh"

socket=$1
shift
ctr=(ctr --address "$socket" -n k8s.io)
keep=()
for ref in "$@"; do
	keep+=("$("${ctr[@]}" images ls "name==$ref" | awk 'NR == 2 {print $3}')")
done
"${ctr[@]}" images ls | awk 'NR > 1 {print $1, $3}' | while read -r ref digest; do
	case " ${keep[*]} " in
	*" $digest "*) ;;
	*) "${ctr[@]}" images rm "$ref" >/dev/null ;;
	esac
done

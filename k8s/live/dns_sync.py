"""The live node's cluster DNS records: keeps dnsmasq's hosts file equal to the cluster's Services.

CoreDNS cannot be pulled here, so dnsmasq answers `*.cluster.local` from a hosts file and this keeps the file
current, with the records CoreDNS would serve for the names the manifests use:
  SERVICE.NAMESPACE.svc.cluster.local -> the Service's ClusterIP, or for a headless Service (clusterIP: None)
                                         the address of every ready pod behind it (its Endpoints' addresses,
                                         not the notReadyAddresses), so a pod leaves DNS when it turns unready.
It polls the API server once a second (two list calls) and signals dnsmasq (SIGHUP re-reads the file) on change.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def _client(kubeconfig: Path) -> tuple[str, dict[str, str], ssl.SSLContext]:
    """The API server's URL, auth header and TLS context from the live node's kubeconfig (token auth)."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    server = cfg["clusters"][0]["cluster"]["server"]
    token = cfg["users"][0]["user"]["token"]
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the API server's self-signed certificate, on loopback
    return server, {"Authorization": f"Bearer {token}"}, ctx


def _get(base: str, headers: dict[str, str], ctx: ssl.SSLContext, path: str) -> Any:
    req = urllib.request.Request(base + path, headers=headers)
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return json.load(resp)


def records(services: dict[str, Any], endpoints: dict[str, Any]) -> list[str]:
    """hosts-file lines, sorted: one per (address, name)."""
    ready: dict[tuple[str, str], list[str]] = {}
    for ep in endpoints.get("items", []):
        key = (ep["metadata"]["namespace"], ep["metadata"]["name"])
        for subset in ep.get("subsets") or []:
            ready.setdefault(key, []).extend(a["ip"] for a in subset.get("addresses") or [])
    lines: set[str] = set()
    for svc in services.get("items", []):
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        fqdn = f"{name}.{ns}.svc.cluster.local"
        cluster_ip = svc["spec"].get("clusterIP")
        addresses = ready.get((ns, name), []) if cluster_ip in (None, "None") else [cluster_ip]
        lines.update(f"{ip} {fqdn}" for ip in addresses)
    return sorted(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--hosts", type=Path, required=True, help="the hosts file dnsmasq reads (--addn-hosts)")
    parser.add_argument("--dnsmasq-pid", type=int, required=True)
    args = parser.parse_args(argv)
    base, headers, ctx = _client(args.kubeconfig)
    last: list[str] | None = None
    while True:
        try:
            lines = records(_get(base, headers, ctx, "/api/v1/services"), _get(base, headers, ctx, "/api/v1/endpoints"))
        except (OSError, ValueError) as exc:  # the API server restarting, or not up yet: try again
            print(f"dns-sync: {exc}", file=sys.stderr, flush=True)
            time.sleep(1)
            continue
        if lines != last:
            tmp = args.hosts.with_suffix(".tmp")
            tmp.write_text("".join(f"{line}\n" for line in lines))
            os.replace(tmp, args.hosts)
            os.kill(args.dnsmasq_pid, signal.SIGHUP)
            print(time.strftime("%H:%M:%S"), "records:", "; ".join(lines), flush=True)
            last = lines
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())

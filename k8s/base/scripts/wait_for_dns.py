"""Init container: wait until a headless Service name resolves, i.e. until at least one of its pods is ready.

A headless Service publishes only ready pods in DNS, and rewardmesh clients resolve `dns:///` targets when
they start, so a rollout server (or trainer) that starts before any reward (or rollout) pod is ready would
exit with a configuration error and crash-loop. Usage: python wait_for_dns.py HOST [TIMEOUT_S]
"""

import socket
import sys
import time


def main() -> int:
    host = sys.argv[1]
    timeout_s = float(sys.argv[2]) if len(sys.argv) > 2 else 1800.0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            addresses = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                print(f"{host} did not resolve within {timeout_s:.0f}s ({exc}); giving up", file=sys.stderr)
                return 1
            time.sleep(2)
            continue
        print(f"{host} resolves to {', '.join(addresses)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running untrusted programs (a policy's code) against tests, contained by the kernel's namespaces and rlimits
through bubblewrap, or util-linux `unshare` where bubblewrap is missing. See docs/code-sandbox.md."""

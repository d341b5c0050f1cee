"""Weight updates, one module per data plane, each holding its sender and receiver side next to each other.

- grpc_chunks: chunks on `UpdateWeights` (the plane every server takes).
- shm: one file under /dev/shm written by the trainer, mapped by every server on its host.
- dist: a torch.distributed broadcast or chain, servers of one host sharing one copy.
- cuda_ipc: CUDA tensors a colocated server opens where they lie.

What every plane shares: the manifest and its validator (manifest), byte layouts (layout), digests and
finiteness (digests), delta encoding (delta).
"""

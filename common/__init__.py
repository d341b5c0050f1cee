"""What trainers and servers both use: errors, tensors on the wire, weight manifests and planes, channels, telemetry."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.common")

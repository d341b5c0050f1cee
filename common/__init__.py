"""What trainers and servers both use: tensors on the wire, weight manifests and planes, channels, telemetry."""

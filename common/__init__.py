"""What trainers and servers both use: errors, tensors on the wire, weight manifests and planes, channels, telemetry."""

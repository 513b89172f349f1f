"""The fleet: radixkv replicas on Ray Serve, routed by what each has cached."""

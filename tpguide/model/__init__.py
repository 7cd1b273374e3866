"""Model side: config, tensor-parallel layers, architectures, weight loading."""

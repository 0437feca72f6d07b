"""Compiled decoding steps: ahead-of-time inductor packages of the model's forward pass, and our CPU kernels."""

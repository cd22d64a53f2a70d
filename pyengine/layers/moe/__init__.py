"""Mixture-of-experts layers (issue 49): routing (routing.py) and the float64 reference
the fused kernels are checked against (reference.py)."""

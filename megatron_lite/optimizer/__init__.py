"""Optimizers, loss scaling and gradient clipping for mixed-precision, parallel training."""

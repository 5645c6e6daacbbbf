"""Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1)."""

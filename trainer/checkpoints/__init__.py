"""Checkpoints: per-site DCP checkpoints with signed manifests, and their copies in object stores.
"""

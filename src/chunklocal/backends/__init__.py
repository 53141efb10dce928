"""Attention backends: one file each, all behind the interface in ``base``."""

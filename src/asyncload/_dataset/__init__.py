"""Datasets and how samples are asked of them: base classes, sharding, errors."""

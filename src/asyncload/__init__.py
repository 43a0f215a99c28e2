"""asyncload."""

"""The DataLoader, its passes, and its state."""

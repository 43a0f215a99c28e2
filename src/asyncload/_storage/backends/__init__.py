"""One module per scheme, behind ``base.Backend``."""

"""How worker processes start: context, forkserver, guards, preload."""

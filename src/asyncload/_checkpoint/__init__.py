"""Where a pass stands, as values: resume points, fingerprints, elastic re-deals."""

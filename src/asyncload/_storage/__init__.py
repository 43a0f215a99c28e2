"""Storage: read, stream, stat and list over every scheme; retries, hedges, cache."""

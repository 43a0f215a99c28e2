"""How batches cross from a worker to the main process: pickling, shared memory."""

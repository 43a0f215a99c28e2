"""Messages between the main process and its workers; NOTE [ Data flow and shutdown ]."""

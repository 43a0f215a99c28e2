"""Counters: the recorder every storage call notes into, and the loader's stats."""

"""Stage 4, hardware: the devices a step runs on.

``devices`` (the catalogue ``devices.toml``: peaks by precision, bandwidth, special-function
rates, with sources; user device files), ``calibrate`` (measuring this machine). Imports nothing
from the op graph's consumers.
"""

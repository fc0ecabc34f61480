"""Maintenance scripts for the detectors package (not imported at run time)."""

"""Duet."""

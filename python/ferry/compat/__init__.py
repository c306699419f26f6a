"""Compatibility layers that let code written for other transfer engines run on Ferry."""

"""Whole jobs made of the stages (the demo). May import any package; only the CLI imports it."""

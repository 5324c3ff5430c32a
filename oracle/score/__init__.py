"""Judging gradients: tolerances, layer grouping, end-to-end and local scoring, explain. Imports
replay and everything below it."""
